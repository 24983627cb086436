"""bench_methods.py: method names and presets."""
import pytest

import bench_methods
from errors import UsageError


def test_method_names():
    heads = {"eagle3": object()}
    ms = bench_methods.expand_methods("main,ablations", heads, [8192], [512], [], 3072)
    names = [m.name for m in ms]
    assert (names[:4] == ["ar", "ar-fast", "ngram", "eagle3"] and "eagle3+freq-8k" in names
            and "eagle3+nanospec-noasync" in names)
    assert bench_methods.method_from_name("eagle3+nanospec-w1k", heads, 3072).k == 1024
    with pytest.raises(UsageError, match="EAGLE2"):
        bench_methods.method_from_name("eagle2", heads, 3072)
    assert ([m.name for m in bench_methods.expand_methods("main", {}, [8192], [], [], 3072)]
            == ["ar", "ar-fast", "ngram"])
