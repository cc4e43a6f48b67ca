"""load_weights: safetensors as stored, GGUF dequantised, llama.cpp's q/k permutation undone."""

from __future__ import annotations

import functools
import json
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from radixkv.checkpoint import Checkpoint, CheckpointError, resolve_checkpoint
from radixkv.worker.loader import load_weights


def safetensors_weights(directory: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return weights


# --- Hugging Face directories -----------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama3_sharded_dir"])
def test_hf_weights_are_the_safetensors_tensors(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    directory: Path = request.getfixturevalue(fixture)
    loaded = load_weights(resolve_checkpoint(directory))
    assert isinstance(loaded, Iterator)
    ours = dict(loaded)
    expected = safetensors_weights(directory)
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor), name


def test_qwen2_has_qkv_biases_and_no_lm_head(tiny_qwen2_dir: Path) -> None:
    names = {name for name, _ in load_weights(resolve_checkpoint(tiny_qwen2_dir))}
    assert "lm_head.weight" not in names
    assert {f"model.layers.1.self_attn.{p}_proj.bias" for p in "qkv"} <= names
    assert "model.layers.1.self_attn.o_proj.bias" not in names


def test_tied_checkpoint_that_stores_lm_head_yields_none(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    directory = Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    names = [name for name, _ in load_weights(resolve_checkpoint(directory))]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_hf_weights_cast_to_dtype(tiny_llama_dir: Path) -> None:
    expected = safetensors_weights(tiny_llama_dir)
    for name, tensor in load_weights(resolve_checkpoint(tiny_llama_dir), torch.bfloat16):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


# --- GGUF: names, layout, permutation ---------------------------------------------------------


@pytest.mark.parametrize(
    ("gguf_fixture", "hf_fixture"),
    [("tiny_llama_gguf", "tiny_llama_dir"), ("tiny_qwen2_gguf", "tiny_qwen2_dir")],
)
def test_converted_gguf_loads_back_to_the_hf_weights(
    gguf_fixture: str, hf_fixture: str, request: pytest.FixtureRequest
) -> None:
    """llama: q/k rows were permuted by the converter and must come back; qwen2: never permuted."""
    ours = dict(load_weights(resolve_checkpoint(request.getfixturevalue(gguf_fixture))))
    expected = safetensors_weights(request.getfixturevalue(hf_fixture))
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


@pytest.fixture(scope="session")
def smollm2_transformers_weights(smollm2_gguf: Path) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loading of the default model, once per session.

    As is, it costs ~35 s of CPU here: transformers rebuilds gguf's tensor-name table for each of
    ~400 modules, and reads the file with gguf.GGUFReader twice, turning every field into Python
    values each time, a 49k-token vocabulary included. While it loads we cache both (pure
    functions of their arguments) and hide the tokenizer.ggml.* fields, which weight loading
    never reads. The tensors it returns are unchanged.
    """
    from transformers import AutoModelForCausalLM

    readers: dict[str, Any] = {}

    def cached_reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) not in readers:
            reader = real_reader(path, *args, **kwargs)
            for key in [key for key in reader.fields if key.startswith("tokenizer.ggml.")]:
                del reader.fields[key]
            readers[str(path)] = reader
        return readers[str(path)]

    real_reader = gguf.GGUFReader
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        patch.setattr(gguf, "GGUFReader", cached_reader)
        model = AutoModelForCausalLM.from_pretrained(
            smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
        )
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_loading(
    smollm2_transformers_weights: dict[str, torch.Tensor],
) -> None:
    ckpt = resolve_checkpoint(None)
    ours = dict(load_weights(ckpt))
    # transformers lists the tied lm_head (the embedding itself); we yield it only when untied.
    assert ours.keys() == smollm2_transformers_weights.keys() - {"lm_head.weight"}
    assert len(ours) == 2 + 9 * 30
    for name, tensor in ours.items():
        reference = smollm2_transformers_weights[name]
        assert tensor.shape == reference.shape, name
        # torch.equal first: assert_close would cost ~9 s of CPU on these 135M weights.
        assert torch.equal(tensor, reference) or (tensor - reference).abs().max() <= 1e-6, name
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ours["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


# --- GGUF: dequantisation, against block layouts decoded by hand --------------------------------

ROWS, ROW_LEN = 64, 256  # ffn_up of a model of width 256: (intermediate, hidden)


def f16(raw: bytes) -> float:
    return float(np.frombuffer(raw, np.float16)[0])


def ref_q8_0(block: bytes) -> list[float]:
    """d: f16, qs: int8[32]; x = d * q."""
    d = f16(block[:2])
    return [d * q for q in np.frombuffer(block[2:], np.int8).tolist()]


def ref_q4(block: bytes, with_min: bool) -> list[float]:
    """Q4_0: d, qs[16] (x = (q - 8) * d); Q4_1: d, m, qs[16] (x = q * d + m).

    Byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
    """
    d = f16(block[:2])
    m = f16(block[2:4]) if with_min else 0.0
    qs = block[4:] if with_min else block[2:]
    offset = 0 if with_min else 8
    low = [(b & 0xF) - offset for b in qs]
    high = [(b >> 4) - offset for b in qs]
    return [q * d + m for q in low + high]


def ref_q5(block: bytes, with_min: bool) -> list[float]:
    """Q5_0: d, qh (u32), qs[16], x = (q - 16) * d; Q5_1: d, m, qh, qs[16], x = q * d + m.

    The 5th bit of weight j is bit j of qh; of weight j + 16, bit j + 16.
    """
    d = f16(block[:2])
    m = f16(block[2:4]) if with_min else 0.0
    rest = block[4:] if with_min else block[2:]
    (qh,) = struct.unpack("<I", rest[:4])
    qs = rest[4:]
    offset = 0 if with_min else 16
    low = [(qs[j] & 0xF | ((qh >> j) & 1) << 4) - offset for j in range(16)]
    high = [(qs[j] >> 4 | ((qh >> (j + 16)) & 1) << 4) - offset for j in range(16)]
    return [q * d + m for q in low + high]


def k_scale_min(scales: bytes, j: int) -> tuple[int, int]:
    """6-bit scale and min of sub-block j (of 8) packed in 12 bytes."""
    if j < 4:
        return scales[j] & 63, scales[j + 4] & 63
    return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | (
        (scales[j] >> 6) << 4
    )


def ref_q4_k(block: bytes) -> list[float]:
    """d, dmin (f16), scales[12], qs[128]: 8 sub-blocks of 32, x = d*sc*q - dmin*m.

    Each 32-byte chunk of qs holds sub-block 2i in its low nibbles and 2i + 1 in its high ones.
    """
    d, dmin, scales, qs = f16(block[:2]), f16(block[2:4]), block[4:16], block[16:]
    out: list[float] = []
    for sub, nibbles in enumerate(k_nibbles(qs)):
        sc, m = k_scale_min(scales, sub)
        out += [d * sc * v - dmin * m for v in nibbles]
    return out


def k_nibbles(qs: bytes) -> list[list[int]]:
    """The 8 sub-blocks of 32 4-bit values in 128 bytes: per 32-byte chunk, low then high."""
    chunks = [qs[32 * i : 32 * i + 32] for i in range(4)]
    return [[b >> shift & 0xF for b in chunk] for chunk in chunks for shift in (0, 4)]


def ref_q5_k(block: bytes) -> list[float]:
    """Q4_K plus qh[32]: bit `sub` of qh[i] is the 5th bit of weight i of sub-block `sub`."""
    d, dmin, scales = f16(block[:2]), f16(block[2:4]), block[4:16]
    qh, qs = block[16:48], block[48:]
    out: list[float] = []
    for sub, nibbles in enumerate(k_nibbles(qs)):
        sc, m = k_scale_min(scales, sub)
        out += [d * sc * (v + 16 * (qh[i] >> sub & 1)) - dmin * m for i, v in enumerate(nibbles)]
    return out


def ref_q6_k(block: bytes) -> list[float]:
    """ql[128], qh[64], scales int8[16], d (f16): 16 sub-blocks of 16, x = d*sc*(q - 32).

    Per half of 128 weights (ql 64 bytes, qh 32 bytes), weight i + 32*k (k = 0..3) takes
    the low/high nibble of ql[i] or ql[i + 32] and bits 2k, 2k+1 of qh[i].
    """
    ql_all, qh_all = block[:128], block[128:192]
    scales = np.frombuffer(block[192:208], np.int8).tolist()
    d = f16(block[208:210])
    out = [0.0] * 256
    for half in range(2):
        ql, qh = ql_all[64 * half : 64 * half + 64], qh_all[32 * half : 32 * half + 32]
        for i in range(32):
            quants = (
                (ql[i] & 0xF) | ((qh[i] >> 0) & 3) << 4,
                (ql[i + 32] & 0xF) | ((qh[i] >> 2) & 3) << 4,
                (ql[i] >> 4) | ((qh[i] >> 4) & 3) << 4,
                (ql[i + 32] >> 4) | ((qh[i] >> 6) & 3) << 4,
            )
            for k, q in enumerate(quants):
                out[128 * half + 32 * k + i] = d * scales[8 * half + i // 16 + 2 * k] * (q - 32)
    return out


def ref_bf16(block: bytes) -> list[float]:
    (bits,) = struct.unpack("<H", block)
    return [struct.unpack("<f", struct.pack("<I", bits << 16))[0]]


REFERENCES: dict[Q, Callable[[bytes], list[float]]] = {
    Q.Q8_0: ref_q8_0,
    Q.Q4_0: functools.partial(ref_q4, with_min=False),
    Q.Q4_1: functools.partial(ref_q4, with_min=True),
    Q.Q5_0: functools.partial(ref_q5, with_min=False),
    Q.Q5_1: functools.partial(ref_q5, with_min=True),
    Q.Q4_K: ref_q4_k,
    Q.Q5_K: ref_q5_k,
    Q.Q6_K: ref_q6_k,
    Q.BF16: ref_bf16,
}
# Largest |dequantised - source| for source weights in [-1, 1): half a quantisation step (a
# whole one for Q4_0 and Q5_0, whose levels -8..7 and -16..15 clip the side opposite the
# largest magnitude).
QUANTISED_TOLERANCE = {Q.Q8_0: 0.005, Q.Q4_0: 0.13, Q.Q4_1: 0.07, Q.Q5_0: 0.07, Q.Q5_1: 0.035,
                       Q.BF16: 0.004}


def k_quant_blocks(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantise these) with sane f16 scales."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(ROWS, type_size), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.02, size=(ROWS, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        blocks[:, 208:210] = scale[:, :2]
    else:
        blocks[:, 0:4] = scale
    return blocks


def expected_values(raw: np.ndarray, qtype: Q) -> np.ndarray:
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = raw.tobytes()
    reference = REFERENCES[qtype]
    values = [v for i in range(0, len(data), type_size) for v in reference(data[i : i + type_size])]
    return np.array(values, dtype=np.float64).reshape(ROWS, ROW_LEN)


def write_one_tensor_gguf(write_gguf: Any, path: Path, tensor: Any) -> Checkpoint:
    metadata = {
        "llama.block_count": 1, "llama.context_length": 64, "llama.embedding_length": ROW_LEN,
        "llama.feed_forward_length": ROWS, "llama.attention.head_count": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 32,
    }
    return resolve_checkpoint(write_gguf(path, "llama", metadata, {"blk.0.ffn_up.weight": tensor}))


def load_ffn_up(ckpt: Checkpoint) -> np.ndarray:
    (name, tensor), = load_weights(ckpt)
    assert name == "model.layers.0.mlp.up_proj.weight"
    assert tensor.shape == (ROWS, ROW_LEN) and tensor.dtype == torch.float32
    return tensor.numpy()


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16], ids=lambda q: q.name)
def test_float_tensors_load_exactly(qtype: Q, write_gguf: Any, tmp_path: Path) -> None:
    source = np.random.default_rng(0).uniform(-1, 1, (ROWS, ROW_LEN))
    source = source.astype(np.float32 if qtype == Q.F32 else np.float16)
    ckpt = write_one_tensor_gguf(write_gguf, tmp_path / "m.gguf", source)
    np.testing.assert_array_equal(load_ffn_up(ckpt), source.astype(np.float32))


@pytest.mark.parametrize("qtype", list(QUANTISED_TOLERANCE), ids=lambda q: q.name)
def test_quantised_tensors_match_their_block_layout(
    qtype: Q, write_gguf: Any, tmp_path: Path
) -> None:
    source = np.random.default_rng(1).uniform(-1, 1, (ROWS, ROW_LEN)).astype(np.float32)
    raw = gguf.quants.quantize(source, qtype)
    ckpt = write_one_tensor_gguf(write_gguf, tmp_path / "m.gguf", (raw, qtype))
    loaded = load_ffn_up(ckpt)
    np.testing.assert_allclose(loaded, expected_values(raw, qtype), rtol=1e-6, atol=1e-7)
    assert np.abs(loaded - source).max() <= QUANTISED_TOLERANCE[qtype]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quant_tensors_match_their_block_layout(
    qtype: Q, write_gguf: Any, tmp_path: Path
) -> None:
    raw = k_quant_blocks(qtype, np.random.default_rng(2))
    ckpt = write_one_tensor_gguf(write_gguf, tmp_path / "m.gguf", (raw, qtype))
    np.testing.assert_allclose(load_ffn_up(ckpt), expected_values(raw, qtype), rtol=1e-6, atol=1e-6)


def test_dequantised_tensor_casts_to_dtype(write_gguf: Any, tmp_path: Path) -> None:
    source = np.random.default_rng(3).uniform(-1, 1, (ROWS, ROW_LEN)).astype(np.float32)
    raw = gguf.quants.quantize(source, Q.Q8_0)
    ckpt = write_one_tensor_gguf(write_gguf, tmp_path / "m.gguf", (raw, Q.Q8_0))
    (_, tensor), = load_weights(ckpt, torch.float16)
    assert tensor.dtype == torch.float16
    assert torch.equal(tensor, torch.from_numpy(load_ffn_up(ckpt)).to(torch.float16))


# --- GGUF refusals ----------------------------------------------------------------------------


def test_unsupported_quantisation_names_type_and_tensor(
    write_gguf: Any, tmp_path: Path, tiny_llama_gguf: Path
) -> None:
    """resolve_checkpoint refuses the file first; the loader refuses on its own too."""
    q2_k = np.zeros((ROWS, gguf.GGML_QUANT_SIZES[Q.Q2_K][1]), np.uint8)
    path = write_gguf(tmp_path / "q2k.gguf", "llama", {}, {"blk.0.ffn_up.weight": (q2_k, Q.Q2_K)})
    config = resolve_checkpoint(tiny_llama_gguf).model_config
    ckpt = Checkpoint(kind="gguf", path=path, name="q2k", model_config=config, chat_template=None)
    with pytest.raises(CheckpointError, match="blk.0.ffn_up.weight has quantisation type Q2_K"):
        list(load_weights(ckpt))


def test_unknown_gguf_tensor_is_refused(
    write_gguf: Any, tmp_path: Path, tiny_llama_gguf: Path
) -> None:
    path = write_gguf(tmp_path / "moe.gguf", "llama", {},
                      {"blk.0.ffn_gate_exps.weight": np.zeros((4, 32), np.float32)})
    config = resolve_checkpoint(tiny_llama_gguf).model_config
    ckpt = Checkpoint(kind="gguf", path=path, name="moe", model_config=config, chat_template=None)
    with pytest.raises(CheckpointError, match="unexpected GGUF tensor blk.0.ffn_gate_exps.weight"):
        list(load_weights(ckpt))


def test_tensor_past_the_end_of_the_file(write_gguf: Any, tmp_path: Path) -> None:
    source = np.ones((ROWS, ROW_LEN), np.float32)
    ckpt = write_one_tensor_gguf(write_gguf, tmp_path / "m.gguf", source)
    data = ckpt.path.read_bytes()
    ckpt.path.write_bytes(data[: len(data) - 1024])
    with pytest.raises(CheckpointError, match="blk.0.ffn_up.weight runs past the end of the file"):
        list(load_weights(ckpt))
