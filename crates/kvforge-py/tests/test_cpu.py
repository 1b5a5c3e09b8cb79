"""CPU-only tests of the kvforge Python package: argument validation, error mapping and
configuration checks that need no GPU (CI has none). GPU tests: test_gpu.py, on the device."""

import pickle
from pathlib import Path

import pytest

import kvforge

REPO = Path(__file__).resolve().parents[3]
RDKV = str(REPO / "specs" / "rdkv.toml")


class Dtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return self.name


class Dev:
    def __init__(self, type, index=None):
        self.type = type
        self.index = index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


class FakeTensor:
    """What kvforge reads from a torch tensor, without torch."""

    def __init__(self, shape, dtype="torch.float16", device=("cuda", 0), strides=None, ptr=0x7F00_0000_0000):
        self.shape = tuple(shape)
        self.dtype = Dtype(dtype)
        self.device = Dev(*device)
        if strides is None:
            strides, acc = [], 1
            for n in reversed(self.shape):
                strides.insert(0, acc)
                acc *= n
        self._strides = tuple(strides)
        self._ptr = ptr

    def data_ptr(self):
        return self._ptr

    def stride(self):
        return self._strides


def err(fn, *a, **kw):
    with pytest.raises(kvforge.KvforgeError) as e:
        fn(*a, **kw)
    return e.value


def test_exports():
    for name in kvforge.__all__:
        assert hasattr(kvforge, name), name
    assert kvforge.__version__
    assert kvforge.Cache.__doc__ and "spec" in kvforge.Cache.__doc__


@pytest.mark.parametrize("kw, needle", [
    (dict(coverage=1.5), "coverage"),
    (dict(explore=-0.1), "explore"),
    (dict(max_error=float("nan")), "max_error"),
    (dict(page_in="disk"), "page_in"),
    (dict(min_blocks=5, max_blocks=2), "min_blocks"),
    (dict(path="cpu"), "path"),
    (dict(layer_fallback=-0.5), "layer_fallback"),
])
def test_certifier_settings_are_checked(kw, needle):
    with pytest.raises(kvforge.KvforgeError) as e:
        kvforge.Certifier(**kw)
    assert e.value.kind == "BadInput" and needle in str(e.value)
    assert "Certifier" in repr(kvforge.Certifier())


def test_certifier_exposes_path_and_ranking_options():
    c = kvforge.Certifier()
    cfg = c.config
    assert (cfg["path"], cfg["effective_path"], cfg["page_in"]) == ("gpu", "gpu", "uva")
    assert (cfg["rank_depth"], cfg["rank_escalate"], cfg["profile"], cfg["max_blocks"]) == (1, True, False, None)
    assert c.kernel_us is None and c.host_ladder is False
    c = kvforge.Certifier(path="host", rank_depth=3, rank_escalate=False, profile=True, max_blocks=7, layer_fallback=1.1)
    cfg = c.config
    assert (cfg["path"], cfg["effective_path"]) == ("host", "host")
    assert (cfg["rank_depth"], cfg["rank_escalate"], cfg["profile"], cfg["max_blocks"], cfg["layer_fallback"]) == (3, False, True, 7, 1.1)
    # The device path addresses the originals itself: with copied page-in the step runs on the host.
    cfg = kvforge.Certifier(path="gpu", page_in="copy").config
    assert (cfg["path"], cfg["effective_path"], cfg["page_in"]) == ("gpu", "host", "copy")
    assert kvforge.Certifier(rank_depth=0).config["rank_depth"] == 0
    # Issue 24: a KvforgeError naming the argument, not a bare OverflowError.
    e = err(kvforge.Certifier, rank_depth=-1)
    assert e.kind == "BadInput" and str(e).startswith("rank_depth: must be a non-negative integer"), str(e)


def test_controller_and_certificate_classes_are_documented():
    for cls in (kvforge.Controller, kvforge.ControlReport, kvforge.Certifier, kvforge.HeadCertificate):
        assert cls.__doc__, cls


def test_importance_window_api_is_documented():
    # the GPU tests exercise them; here: they exist with their keywords documented
    assert "track" in kvforge.Cache.decode.__doc__ and "take_mass_window" in kvforge.Cache.decode.__doc__
    assert "track" in kvforge.Cache.plan.__doc__
    assert "resets" in kvforge.Cache.take_mass_window.__doc__
    assert "window=True" in kvforge.Controller.apply.__doc__
    for name in ("importance", "forget"):
        assert getattr(kvforge.Controller, name).__doc__, name
    assert "tracked" in dir(kvforge.Plan)


def test_error_is_value_and_runtime_error_and_pickles():
    e = kvforge.KvforgeError("boom", "BadInput")
    assert isinstance(e, ValueError) and isinstance(e, RuntimeError)
    assert e.kind == "BadInput" and str(e) == "boom"
    e2 = pickle.loads(pickle.dumps(e))
    assert (type(e2), str(e2), e2.kind) == (kvforge.KvforgeError, "boom", "BadInput")


def test_check_tensor_accepts_a_contiguous_cuda_tensor():
    kvforge.check_tensor(FakeTensor((5, 3, 64)), "k", [5, 3, 64])
    kvforge.check_tensor(FakeTensor((5, 3, 64), dtype="torch.bfloat16"), "k", [5, 3, 64], dtype="bfloat16")
    kvforge.check_tensor(FakeTensor((2, 9), dtype="torch.float32", device=("cuda", 1)), "lse", [2, 9], dtype="float32", device=1)
    # Size-1 dims may carry any stride (torch does this for unsqueezed views).
    kvforge.check_tensor(FakeTensor((1, 3, 64), strides=(999, 64, 1)), "q", [1, 3, 64])


@pytest.mark.parametrize(
    "tensor, shape, dtype, device, needle",
    [
        (FakeTensor((5, 3, 64), dtype="torch.float32"), [5, 3, 64], "float16", 0, "`k` is float32 but must be float16"),
        (FakeTensor((5, 3, 64), dtype="torch.float64"), [5, 3, 64], "float16", 0, "torch.float64 but must be float16"),
        (FakeTensor((5, 3, 64), device=("cpu", None)), [5, 3, 64], "float16", 0, "`k` is on cpu"),
        (FakeTensor((5, 3, 64), device=("cuda", 1)), [5, 3, 64], "float16", 0, "cuda:1 but the cache is on cuda:0"),
        (FakeTensor((5, 3, 32)), [5, 3, 64], "float16", 0, "has shape [5, 3, 32]; expected [5, 3, 64]"),
        (FakeTensor((5, 64)), [5, 3, 64], "float16", 0, "has shape [5, 64]"),
        (FakeTensor((5, 3, 64), strides=(64, 320, 1)), [5, 3, 64], "float16", 0, "not contiguous"),
        (FakeTensor((5, 3, 64), strides=(384, 128, 2)), [5, 3, 64], "float16", 0, "not contiguous"),
        (FakeTensor((5, 3, 64), ptr=0x7F00_0000_0001), [5, 3, 64], "float16", 0, "not aligned"),
        (FakeTensor((5, 3, 64), ptr=0), [5, 3, 64], "float16", 0, "null data pointer"),
    ],
)
def test_check_tensor_says_what_is_wrong(tensor, shape, dtype, device, needle):
    e = err(kvforge.check_tensor, tensor, "k", shape, dtype=dtype, device=device)
    assert e.kind == "BadInput"
    assert needle in str(e), str(e)


@pytest.mark.parametrize("obj", [[1, 2, 3], None, 3.0, "tensor", object()])
def test_non_tensors_are_rejected_by_name(obj):
    e = err(kvforge.check_tensor, obj, "q", [3])
    assert "`q` must be a torch tensor" in str(e)


def test_real_cpu_torch_tensor_is_rejected():
    torch = pytest.importorskip("torch")
    e = err(kvforge.check_tensor, torch.zeros(5, 3, 64, dtype=torch.float16), "k", [5, 3, 64])
    assert "`k` is on cpu" in str(e)
    t = torch.zeros(3, 5, 64, dtype=torch.float16).transpose(0, 1)
    assert "not contiguous" in str(err(kvforge.check_tensor, t, "k", [5, 3, 64]))


def cache(**kw):
    args = dict(spec=RDKV, head_dim=64, num_kv_heads=3, gqa=3, max_tokens=1024)
    args.update(kw)
    return kvforge.Cache(**args)


@pytest.mark.parametrize(
    "kw, kind, needle",
    [
        (dict(head_dim=48), "BadInput", "head_dim 48 is not in spec `rdkv`"),
        (dict(gqa=5), "BadInput", "gqa 5 is not in spec `rdkv`"),
        (dict(num_kv_heads=0), "BadInput", "must be at least 1"),
        (dict(max_tokens=0), "BadInput", "must be at least 1"),
        (dict(target="b3"), "BadInput", "no tier `b3` (tiers: tail, b16, b8, b4, b2, b0)"),
        (dict(target="b0"), "BadInput", "tier `b0` cannot be the target"),
        (dict(target="tail"), "BadInput", "tier `tail` cannot be the target"),
        (dict(target=17), "BadInput", "tier id 17 out of range"),
        (dict(spec="specs/does-not-exist.toml"), "Spec", "spec file `specs/does-not-exist.toml` not found"),
    ],
)
def test_cache_configuration_is_checked_before_the_device(kw, kind, needle):
    e = err(cache, **kw)
    assert e.kind == kind, (e.kind, str(e))
    assert needle in str(e), str(e)


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=10**30), "max_tokens"),
        (dict(head_dim="64"), "head_dim"),
        (dict(num_kv_heads=2.5), "num_kv_heads"),
        (dict(sequences=-3), "sequences"),
        (dict(device=-1), "device"),
    ],
)
def test_integer_arguments_are_kvforge_errors_naming_the_argument(kw, name):
    # Issue 24: max_tokens=-1 raised a bare OverflowError.
    e = err(cache, **kw)
    assert e.kind == "BadInput", (e.kind, str(e))
    assert str(e).startswith(f"{name}: must be a non-negative integer"), str(e)


@pytest.mark.parametrize(
    "kw, name, what",
    [
        (dict(coverage="high"), "coverage", "a real number"),
        (dict(explore=None), "explore", "a real number"),
        (dict(max_blocks=-2), "max_blocks", "a non-negative integer"),
        (dict(max_blocks="8"), "max_blocks", "a non-negative integer"),
        (dict(profile="yes"), "profile", "True or False"),
        (dict(rank_escalate=1), "rank_escalate", "True or False"),
    ],
)
def test_other_arguments_are_kvforge_errors_naming_the_argument(kw, name, what):
    # Issue 24: floats, flags and optional integers of the wrong type raised PyO3's TypeError.
    with pytest.raises(kvforge.KvforgeError) as e:
        kvforge.Certifier(**kw)
    assert e.value.kind == "BadInput", (e.value.kind, str(e.value))
    assert str(e.value).startswith(f"{name}: must be {what}"), str(e.value)


def test_real_arguments_take_ints_and_none_where_optional():
    assert kvforge.Certifier(coverage=1, max_blocks=None).config["coverage"] == 1.0


class Index:
    """An integer scalar that is not an int (numpy, torch): converts through __index__."""

    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


def test_index_scalars_still_convert():
    kvforge.check_tensor(FakeTensor((5, 3, 64)), "k", [Index(5), 3, 64], device=Index(0))
    e = err(kvforge.check_tensor, FakeTensor((5, 3, 64)), "k", [5, 3, 64], device=Index(-1))
    assert str(e).startswith("device: must be a non-negative integer, got"), str(e)


def test_sequence_arguments_name_the_element():
    e = err(kvforge.check_tensor, FakeTensor((2, 3)), "x", [2, -3])
    assert e.kind == "BadInput" and str(e).startswith("shape: [1]: must be a non-negative integer"), str(e)


def test_a_bad_spec_names_file_line_and_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((REPO / "specs" / "rdkv.toml").read_text().replace("tokens = 64", "tokens = 65"))
    e = err(cache, spec=str(bad))
    assert e.kind == "Spec"
    assert "bad.toml:" in str(e), str(e)


@pytest.mark.skipif(kvforge.driver_present(), reason="a CUDA driver is present")
def test_without_a_driver_errors_are_clear():
    e = err(kvforge.device_info)
    assert e.kind == "NoDriver" and "LD_LIBRARY_PATH" in str(e)
    # A valid configuration gets as far as opening the device.
    e = err(cache, target="b4")
    assert e.kind == "NoDriver"


@pytest.mark.skipif(kvforge.driver_present(), reason="a CUDA driver is present")
def test_relative_spec_paths_resolve_under_root_and_env(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVFORGE_ROOT", raising=False)
    assert err(cache, spec="specs/rdkv.toml").kind == "Spec"
    assert err(cache, spec="specs/rdkv.toml", root=str(REPO)).kind == "NoDriver"
    monkeypatch.setenv("KVFORGE_ROOT", str(REPO))
    assert err(cache, spec="specs/rdkv.toml").kind == "NoDriver"


@pytest.mark.skipif(kvforge.driver_present(), reason="a CUDA driver is present")
def test_serving_additions_are_accepted():
    # target_only is an argument like the others: checked, then the device is opened
    assert err(cache, target="b4", target_only=True).kind == "NoDriver"
    assert err(cache, target="b4", target_only="yes").kind == "BadInput"
    # the window policy (issue 26): page counts, checked, then the device is opened
    assert err(cache, target="b4", sink_pages=1, recent_pages=2).kind == "NoDriver"
    assert err(cache, target="b4", recent_pages=-1).kind == "BadInput"
    assert "window" in dir(kvforge.Cache)
    assert "tile_sequence" in dir(kvforge.Cache) and "Benchmarks build large batches" in kvforge.Cache.tile_sequence.__doc__
    # the device-resident decode plan (issue 29): additive API
    assert "synchronize" in dir(kvforge.Cache) and "resident_stats" in dir(kvforge.Cache)
    assert "replan=True" in kvforge.Cache.decode.__doc__


def test_kvtc_calibration_errors_are_typed(tmp_path):
    assert err(kvforge.KvtcCalibration, str(tmp_path / "missing.safetensors")).kind == "Kvtc"
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a calibration")
    assert err(kvforge.KvtcCalibration, str(junk)).kind == "Kvtc"
    # Cache.save / Cache.load wrap kvtc_save / kvtc_load for one-layer calibrations
    assert "kvtc container" in kvforge.Cache.save.__doc__ and "kvtc container" in kvforge.Cache.load.__doc__


def test_paris_index_arguments_are_typed_errors():
    # bad sizes are KvforgeErrors naming the argument; a valid index gets as far as the device
    assert err(kvforge.ParisIndex, 64, 3, 3, -1).kind == "BadInput"
    assert err(kvforge.ParisIndex, 64, 3, 3, 1024, host_budget_gb=0.0).kind == "BadInput"
    assert err(kvforge.ParisIndex, 64, 3, 3, 1024, rank="mean").kind == "BadInput"
    assert err(kvforge.ParisIndex, 64, 3, 3, 1024, layout="whole3").kind == "BadInput"
    if not kvforge.driver_present():
        assert err(kvforge.ParisIndex, 64, 3, 3, 1024).kind == "NoDriver"
    assert "retrieve" in dir(kvforge.ParisIndex) and "one softmax" in kvforge.ParisIndex.decode.__doc__


def test_retrieval_cache_arguments_are_typed_errors():
    # the main cache + index: bad sizes, rank, layout, spec and target are KvforgeErrors before
    # the device is opened; a valid one gets as far as the device
    assert err(kvforge.RetrievalCache, "specs/rotated.toml", 64, 3, 3, 0).kind == "BadInput"
    assert err(kvforge.RetrievalCache, "specs/rotated.toml", 64, 3, 3, 1024, rank="mean").kind == "BadInput"
    assert err(kvforge.RetrievalCache, "specs/rotated.toml", 64, 3, 3, 1024, layout="whole3").kind == "BadInput"
    assert err(kvforge.RetrievalCache, "specs/none.toml", 64, 3, 3, 1024).kind == "Spec"
    assert err(kvforge.RetrievalCache, "specs/rotated.toml", 64, 3, 3, 1024, target="drop").kind == "BadInput"
    assert err(kvforge.RetrievalCache, "specs/rotated.toml", 64, 3, 3, 1024, target="r9").kind == "BadInput"
    if not kvforge.driver_present():
        assert err(kvforge.RetrievalCache, "specs/rotated.toml", 64, 3, 3, 1024, target="r3").kind == "NoDriver"
    assert "one softmax" in kvforge.RetrievalCache.decode.__doc__


def test_retrieval_window_arguments_are_checked():
    import kvforge.retrieval

    import types

    # The spec's page size, as the native module reads it from the TOML.
    pages = types.SimpleNamespace(spec_page_tokens=lambda spec, root=None: 64)
    for kw in (dict(k=0), dict(local=0), dict(update=0), dict(local=16, update=32), dict(sinks=-1), dict(rank="mean"), dict(layout="whole3"),
               dict(tier="r3"), dict(spec="specs/rotated.toml"), dict(spec="specs/rotated.toml", tier="r3", sinks=32), dict(dense_below=-1)):
        with pytest.raises(ValueError, match="kvforge.retrieval"):
            kvforge.retrieval.ParisAttention(module=pages, **kw)
    # Whole pages of another size pass only where they divide.
    other = types.SimpleNamespace(spec_page_tokens=lambda spec, root=None: 32)
    assert kvforge.retrieval.ParisAttention(module=other, spec="x.toml", tier="r3", sinks=32, local=64, update=32).page == 32
    with pytest.raises(ValueError, match="whole pages of 128"):
        kvforge.retrieval.ParisAttention(module=types.SimpleNamespace(spec_page_tokens=lambda spec, root=None: 128), spec="x.toml", tier="r3")
    assert callable(kvforge.retrieval.use_retrieval)


def test_spec_page_tokens_reads_the_spec():
    # no device needed; a missing spec is a Spec error naming the file
    assert kvforge.spec_page_tokens("specs/rotated.toml", root=str(REPO)) == 64
    assert err(kvforge.spec_page_tokens, "specs/none.toml", root=str(REPO)).kind == "Spec"
