"""The static-shape steps of a batch of one (Runner), where the engine picks them (engine.Engine): compiled
(torch.compile on the CPU), CUDA-graphed, or exact mode's padded passes on the PyTorch layers. Each is a function of
device tensors of fixed shapes with no host sync: the decode step (decode_fn), the verification (verify_step: the
target pass padded to the planned rows, acceptance, KV compaction) and the drafter's update with its next draft
(advance_step); graphs.compile_steps rebinds them from outside. batch.BatchEngine._spec_one drives them."""
import torch
from torch import Tensor

from draft import Accepted, Tree
from exact import PassRows
from model import Plan, Transformer, causal_recent, tree_mask, tree_recent
from planner import Planner
from sampling import Sampling, accept, sample


class Runner:
    """A batch of one's static-shape halves over the target (plan: what its passes return and run on) and its
    drafter; planner: the pass rows of a request's steps. fused: the drafter's update and next draft run as one
    step (compiled; eager keeps them apart to time each)."""

    def __init__(self, model: Transformer, sampling: Sampling, drafter, planner: Planner, plan: Plan, fused: bool):
        self.model, self.sampling, self.drafter, self.planner, self.plan = model, sampling, drafter, planner, plan
        self.device = model.norm.weight.device
        self.fused_steps = fused
        # a one-node tree's accepted path and length (_spec_decode), made once: no allocation inside a step
        self.root_path = (torch.zeros(1, dtype=torch.long, device=self.device),
                          torch.ones((), dtype=torch.long, device=self.device))
        self.decode_fn, self.verify_step, self.advance_step = self._decode_one, self._spec_verify, self._spec_advance

    def _decode_one(self, tok: Tensor, pos: Tensor, rows: PassRows) -> Tensor:
        # padded to rows.gemm rows (exact mode): the pad rows write KV slots the next step overwrites before any read
        R = rows.gemm
        p = pos + torch.arange(R, device=pos.device)
        return self.model(tok.expand(1, R), p, recent=causal_recent(p) if rows.recent else None,
                          attn_rows=rows.attn, plan=self.plan)[:, 0]  # [1, V]

    def _verify(self, tokens: Tensor, depth: Tensor, anc: Tensor, n: Tensor, rows: PassRows):
        # one target pass over the tree: positions n + depth, KV slots n + node index; pad nodes see only themselves
        m, N = self.model, tokens.shape[0]
        R = max(rows.gemm, N)
        if N < R:
            tokens, depth = torch.cat([tokens, tokens.new_zeros(R - N)]), torch.cat([depth, depth.new_zeros(R - N)])
            anc = torch.block_diag(anc, torch.eye(R - N, dtype=torch.bool, device=anc.device))
        mask = tree_mask(m.seq_range, anc, n)
        recent = tree_recent(anc, depth, n) if rows.recent else None
        logits, hid, aux = m(tokens[None], n + depth, mask=mask, cache_pos=n + torch.arange(R, device=n.device),
                             return_hidden=True, recent=recent, attn_rows=max(rows.attn, R), plan=self.plan)
        return logits[0, :N], hid[:, :N], (aux[:, :N] if aux is not None else None)

    def _spec_verify(self, tree: Tree, n: Tensor, rows: PassRows) -> tuple[Tensor, Accepted]:
        # a step's first static-shape, sync-free half: target pass, acceptance, KV compaction (then _spec_advance)
        if self._one_row(tree, rows):
            return self._spec_decode(tree, n)
        logits, hid, aux = self._verify(tree.tokens, tree.depth, tree.anc, n, rows)  # [N, V], [1, N, d], [1, N, 3d]
        path, L, bonus = accept(tree, logits, self.sampling)
        if tree.tokens.shape[0] > 1:  # the accepted path's KV moves to slots n .. n + L - 1
            self.model.compact_kv(n + path, n)
        host = torch.cat([L.view(1), bonus.view(1), tree.tokens[path], path])  # what the host needs, in one sync
        return host, Accepted(tree, path, L, bonus, logits, hid, aux, n)

    def _one_row(self, tree: Tree, rows: PassRows) -> bool:
        """A one-node tree verified as the decode step runs it (exact attention's padded passes excepted)."""
        return tree.tokens.shape[0] == 1 and rows.gemm == 1 and not rows.recent

    def _spec_decode(self, tree: Tree, n: Tensor) -> tuple[Tensor, Accepted]:
        """_spec_verify of a one-node tree as the decode step runs it: 25 fewer small ops (7.21 -> 6.90 ms a step)."""
        logits, hid, aux = self.model(tree.tokens[None], n.view(1), return_hidden=True, plan=self.plan)
        bonus = sample(logits[0], self.sampling).view(())
        path, L = self.root_path  # never written: every reader indexes with them
        host = torch.cat([L.view(1), bonus.view(1), tree.tokens, path])
        return host, Accepted(tree, path, L, bonus, logits[0], hid, aux, n)

    def _spec_advance(self, a: Accepted) -> Tree:
        # one graph: the vocabulary gather on the copy stream overlaps the draft backbone
        self.drafter.update(a)
        return self.drafter.draft(a.bonus.view(1), a.n + a.L)
