"""CPU tests for solforge.zoo: the three ways in, inputs, and every bad-input message."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from solforge.errors import UserError
from solforge.zoo import ZOO, LoadedModel, fresh_like, load_model, zoo_config

KERNELBENCH_FILE = """
import torch
import torch.nn as nn

batch_size = 4
features = 32

class Model(nn.Module):
    def __init__(self, features: int, out: int):
        super().__init__()
        self.linear = nn.Linear(features, out)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x, idx):
        return torch.relu(self.linear(x))[idx]

def get_inputs():
    return [torch.randn(batch_size, features), torch.randint(0, batch_size, (3,))]

def get_init_inputs():
    return [features, 16]
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------- zoo


def test_zoo_names() -> None:
    assert {"qwen3-tiny", "qwen3-0.6b", "qwen3-4b"} <= set(ZOO)


def test_qwen3_tiny_builds_and_runs() -> None:
    lm = load_model("qwen3-tiny")
    assert isinstance(lm, LoadedModel)
    assert lm.name == "qwen3-tiny" and lm.is_language_model
    cfg = lm.model.config
    assert cfg.num_hidden_layers == 2 and len(lm.model.model.layers) == 2
    assert cfg.hidden_size == 64 and cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2
    assert cfg.head_dim == 16 and cfg.intermediate_size == 128
    assert cfg.use_cache is False and cfg._attn_implementation == "sdpa"
    assert not lm.model.training
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())
    (ids,) = lm.example_inputs
    assert ids.shape == (1, 128) and ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < cfg.vocab_size
    with torch.no_grad():
        out = lm.model(*lm.example_inputs)
    assert out.logits.shape == (1, 128, cfg.vocab_size)
    assert out.logits.dtype == torch.bfloat16
    assert bool(torch.isfinite(out.logits.float()).all())
    assert getattr(out, "past_key_values", None) is None  # use_cache=False: logits only


def test_qwen3_tiny_deterministic_per_seed() -> None:
    a = load_model("qwen3-tiny", seed=3)
    b = load_model("qwen3-tiny", seed=3)
    c = load_model("qwen3-tiny", seed=4)
    assert _same_weights(a.model, b.model)
    assert not _same_weights(a.model, c.model)
    assert torch.equal(a.example_inputs[0], b.example_inputs[0])
    assert not torch.equal(a.example_inputs[0], c.example_inputs[0])


def test_load_does_not_disturb_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    load_model("qwen3-tiny", seed=7)
    assert torch.equal(torch.rand(4), expected)


def test_batch_and_seq_shape_inputs() -> None:
    lm = load_model("qwen3-tiny", batch=3, seq=17, dtype=torch.float32)
    assert lm.example_inputs[0].shape == (3, 17)
    assert lm.make_inputs(5)[0].shape == (3, 17)
    with torch.no_grad():
        assert lm.model(*lm.example_inputs).logits.shape == (3, 17, 512)


def test_make_inputs_seeds() -> None:
    lm = load_model("qwen3-tiny", seq=16, seed=0)
    assert torch.equal(lm.make_inputs(0)[0], lm.example_inputs[0])  # the example is make_inputs(seed)
    assert torch.equal(lm.make_inputs(1)[0], lm.make_inputs(1)[0])
    assert not torch.equal(lm.make_inputs(1)[0], lm.example_inputs[0])
    assert not torch.equal(lm.make_inputs(1)[0], lm.make_inputs(2)[0])


def test_make_inputs_never_repeats_example_even_for_one_token() -> None:
    # 1 token from a 512-word vocab: some seeds collide with the example draw unless redrawn.
    lm = load_model("qwen3-tiny", batch=1, seq=1, seed=0, dtype=torch.float32)
    for s in range(1, 1500):
        assert not torch.equal(lm.make_inputs(s)[0], lm.example_inputs[0]), s


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), ("bf16", torch.bfloat16)],
)
def test_dtype_honored(dtype: torch.dtype | str, expected: torch.dtype) -> None:
    default = torch.get_default_dtype()
    lm = load_model("qwen3-tiny", dtype=dtype, seq=8)
    assert {p.dtype for p in lm.model.parameters()} == {expected}
    assert torch.get_default_dtype() == default  # restored after building


def test_published_qwen3_configs() -> None:
    small = zoo_config("qwen3-0.6b")
    assert (small.vocab_size, small.hidden_size, small.intermediate_size) == (151936, 1024, 3072)
    assert (small.num_hidden_layers, small.num_attention_heads, small.num_key_value_heads) == (28, 16, 8)
    big = zoo_config("qwen3-4b")
    assert (big.vocab_size, big.hidden_size, big.intermediate_size) == (151936, 2560, 9728)
    assert (big.num_hidden_layers, big.num_attention_heads, big.num_key_value_heads) == (36, 32, 8)
    for cfg in (small, big):
        assert cfg.head_dim == 128 and cfg.max_position_embeddings == 40960
        assert cfg.rms_norm_eps == 1e-6 and cfg.rope_parameters["rope_theta"] == 1e6
        assert cfg.tie_word_embeddings is True and cfg.use_cache is False
        assert cfg.model_type == "qwen3" and cfg.hidden_act == "silu"
    tiny = zoo_config("QWEN3-TINY")
    assert tiny.num_hidden_layers == 2 and tiny.hidden_size == 64


def test_weights_dir_loads_saved_checkpoint(tmp_path: Path) -> None:
    src = load_model("qwen3-tiny", seed=11, dtype=torch.float32)
    src.model.save_pretrained(tmp_path / "ckpt")
    lm = load_model("qwen3-tiny", weights=str(tmp_path / "ckpt"), dtype=torch.float32, seed=0, seq=8)
    assert _same_weights(lm.model, src.model)
    assert lm.model.config.use_cache is False and lm.model.config._attn_implementation == "sdpa"
    assert not lm.model.training
    with torch.no_grad():
        assert lm.model(*lm.example_inputs).logits.shape == (1, 8, 512)


# ---------------------------------------------------------------- KernelBench file


def test_kernelbench_file_loads_and_runs(tmp_path: Path) -> None:
    path = _write(tmp_path, "level1_relu_linear.py", KERNELBENCH_FILE)
    lm = load_model(str(path), dtype=torch.float16, batch=7, seq=9, seed=1)  # batch/seq ignored
    assert lm.name == str(path) and not lm.is_language_model and not lm.model.training
    assert lm.model.linear.weight.dtype == torch.float16
    assert lm.model.steps.dtype == torch.int64  # non-floating buffers keep their dtype
    x, idx = lm.example_inputs
    assert x.shape == (4, 32) and x.dtype == torch.float16
    assert idx.dtype == torch.int64
    out = lm.model(*lm.example_inputs)
    assert out.shape == (3, 16)
    # Same seed, same weights and inputs; make_inputs(seed) reproduces the example.
    again = load_model(str(path), dtype=torch.float16, seed=1)
    assert _same_weights(lm.model, again.model)
    assert torch.equal(lm.make_inputs(1)[0], x)
    assert not torch.equal(lm.make_inputs(2)[0], x)
    assert lm.make_inputs(2)[0].shape == x.shape and lm.make_inputs(2)[0].dtype == x.dtype


# ---------------------------------------------------------------- module:function


def test_module_function_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(
        tmp_path,
        "sf_zoo_user_mod.py",
        """
        import torch

        class Cfg:
            vocab_size = 10

        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(8, 8)

            def forward(self, x, scale):
                return self.proj(x) * scale

        def build():
            return Tiny(), (torch.randn(2, 8), 2.0)

        def build_lm():
            m = Tiny()
            m.config = Cfg()
            return m, [torch.randn(2, 8), 1.0]
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    lm = load_model("sf_zoo_user_mod:build", dtype=torch.float32)
    assert lm.name == "sf_zoo_user_mod:build" and not lm.is_language_model
    assert lm.model(*lm.example_inputs).shape == (2, 8)
    fresh = lm.make_inputs(1)
    assert fresh[0].shape == (2, 8) and fresh[1] == 2.0
    assert not torch.equal(fresh[0], lm.example_inputs[0])
    assert torch.equal(lm.make_inputs(1)[0], fresh[0])
    half = load_model("sf_zoo_user_mod:build_lm", dtype=torch.bfloat16)
    assert half.is_language_model
    assert half.model.proj.weight.dtype == torch.bfloat16
    assert half.example_inputs[0].dtype == torch.bfloat16
    assert half.make_inputs(3)[0].dtype == torch.bfloat16


def test_file_function_form(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "script.py", "import torch\ndef make():\n    return torch.nn.ReLU(), [torch.randn(3)]\n"
    )
    lm = load_model(f"{path}:make", dtype=torch.float32)
    assert lm.model(*lm.example_inputs).shape == (3,)


# ---------------------------------------------------------------- fresh_like


def test_fresh_like_keeps_shapes_and_changes_values() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=gen, dtype=torch.float32) * 3 + 10
    h = torch.randn(6, generator=gen).to(torch.bfloat16)
    ids = torch.randint(5, 20, (64,), generator=gen, dtype=torch.int32)
    ones = torch.ones(3)
    mask = torch.tensor([True, False, True])
    inputs = (x, [h, ids], {"m": mask}, 7, "s", ones)
    out = fresh_like(inputs, 1)
    assert isinstance(out, tuple) and len(out) == len(inputs)
    fx, (fh, fids), fd, n, s, fones = out
    for new, old in ((fx, x), (fh, h), (fids, ids), (fones, ones)):
        assert new.shape == old.shape and new.dtype == old.dtype and new.device == old.device
        assert not torch.equal(new, old)
    assert abs(float(fx.mean()) - 10) < 3  # matched to the example's scale
    assert int(fids.min()) >= 5 and int(fids.max()) <= 19
    assert torch.equal(fd["m"], mask) and n == 7 and s == "s"
    again = fresh_like(inputs, 1)
    assert torch.equal(again[0], fx)
    assert not torch.equal(fresh_like(inputs, 2)[0], fx)


def test_fresh_like_keeps_requires_grad() -> None:
    x = torch.randn(3, requires_grad=True)
    (fx,) = fresh_like((x,), 0)
    assert fx.requires_grad and fx.is_leaf


# ---------------------------------------------------------------- bad input


def _raises(match: str, *args: object, **kwargs: object) -> str:
    with pytest.raises(UserError) as info:
        load_model(*args, **kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    for part in match.split("|"):
        assert part in message, (part, message)
    return message


def test_unknown_model_name_lists_forms() -> None:
    _raises("unknown model 'llama-99b'|qwen3-tiny|qwen3-4b|.py|package.module:function", "llama-99b")


def test_missing_py_file(tmp_path: Path) -> None:
    _raises("not found", str(tmp_path / "nope.py"))


def test_file_missing_names(tmp_path: Path) -> None:
    path = _write(tmp_path, "partial.py", "import torch\nclass Model(torch.nn.Module):\n    pass\n")
    msg = _raises("get_inputs|get_init_inputs|KernelBench", str(path))
    assert "lacks get_inputs, get_init_inputs" in msg


def test_file_raising_on_import(tmp_path: Path) -> None:
    path = _write(tmp_path, "broken.py", "raise ValueError('bad shape 3 != 4')\n")
    _raises("ValueError: bad shape 3 != 4|broken.py", str(path))
    syntax = _write(tmp_path, "syntax.py", "def f(:\n")
    _raises("SyntaxError", str(syntax))


def test_module_not_importable() -> None:
    _raises("cannot import module 'sf_no_such_pkg.mod'|PYTHONPATH", "sf_no_such_pkg.mod:build")


def test_function_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, "sf_zoo_empty_mod.py", "X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _raises("has no function 'build'", "sf_zoo_empty_mod:build")
    _raises("non-callable 'X'", "sf_zoo_empty_mod:X")


def test_function_bad_return(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(
        tmp_path,
        "sf_zoo_bad_mod.py",
        """
        import torch
        def only_model():
            return torch.nn.ReLU()
        def swapped():
            return [torch.randn(2)], torch.nn.ReLU()
        def bad_inputs():
            return torch.nn.ReLU(), 3
        def boom():
            raise RuntimeError("out of ideas")
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _raises("returned ReLU|(model: nn.Module", "sf_zoo_bad_mod:only_model")
    _raises("as the model", "sf_zoo_bad_mod:swapped")
    _raises("as the inputs", "sf_zoo_bad_mod:bad_inputs")
    _raises("RuntimeError: out of ideas", "sf_zoo_bad_mod:boom")


def test_transformers_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    _raises("pip install 'solforge[hf]'", "qwen3-tiny")


def test_cuda_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _raises("no CUDA device found: run with --device cpu, or on a machine with an NVIDIA GPU",
            "qwen3-tiny", device="cuda")


@pytest.mark.parametrize("device", ["gpu", "tpu:0", "mps"])
def test_unknown_device(device: str) -> None:
    _raises(f"{device!r}|cpu, cuda or cuda:N", "qwen3-tiny", device=device)


@pytest.mark.parametrize(("flag", "value"), [("batch", 0), ("seq", -1), ("seq", 0)])
def test_batch_seq_must_be_positive(flag: str, value: int) -> None:
    _raises(f"--{flag} must be a positive integer", "qwen3-tiny", **{flag: value})


def test_bad_dtype_and_long_seq() -> None:
    _raises("unsupported dtype", "qwen3-tiny", dtype="int8")
    _raises("unsupported dtype", "qwen3-tiny", dtype=torch.int32)
    _raises("longer than qwen3-tiny's context", "qwen3-tiny", seq=100_000)


def test_weights_errors(tmp_path: Path) -> None:
    _raises("does not exist", "qwen3-tiny", weights=str(tmp_path / "missing"))
    _raises("has no config.json", "qwen3-tiny", weights=str(tmp_path))
    zoo_config("qwen3-tiny").save_pretrained(tmp_path / "cfg_only")
    _raises("cannot load weights", "qwen3-tiny", weights=str(tmp_path / "cfg_only"))
    zoo_config("qwen3-0.6b").save_pretrained(tmp_path / "other")
    other = str(tmp_path / "other")
    _raises("not a qwen3-tiny checkpoint|hidden_size 1024 != 64", "qwen3-tiny", weights=other)
    path = _write(tmp_path, "m.py", KERNELBENCH_FILE)
    _raises("--weights applies only to zoo models", str(path), weights=str(tmp_path))
