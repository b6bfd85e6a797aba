"""Checkpoints read: malformed, inconsistent and hostile files of every format raise `vitkit.CheckpointError`
naming the file and the key, never another exception, a crash, or an allocation of what the file claims."""

import json
import re
import resource
import struct
import sys
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import vitkit
from vitkit import formats
from vitkit.errors import CheckpointError
from vitkit.files import read_safetensors

TINY = dict(image_size=16, hidden_size=16, num_layers=1, mlp_dim=32, num_heads=2, num_classes=3)
# Where `vitkit.export` puts a sample of each format ("" = a directory). A new format module in the registry
# without an entry here fails `test_every_registered_format_has_a_fuzz_sample`, so it cannot escape the fuzzing.
SAMPLES = [
    ("vitkit", "model.safetensors"),
    ("timm", "timm.safetensors"),
    ("timm", "timm.pth"),
    ("npz", "official.npz"),
    ("hf", "hf"),
    ("dinov2", "dinov2"),
    ("onnx", "model.onnx"),
]


FUZZ_CASES = 500  # per sample file: 3,500 in all


def tiny_model() -> vitkit.VisionTransformer:
    model = vitkit.create_model("ViT-Ti/8", **TINY)
    model.class_names = ["a", "b", "c"]
    return model


@contextmanager
def address_space_limit(headroom_mb: int):
    """Within the block, allocating more than `headroom_mb` of new address space fails (numpy: MemoryError, torch:
    a RuntimeError), so a reader that allocates what a hostile header claims fails loudly. (The peak RSS,
    `ru_maxrss`, cannot show it: it is the process's lifetime peak, already raised by any earlier test, and an
    untouched allocation does not raise it at all.) Linux only, where the process's size is in /proc."""
    status = Path("/proc/self/status")
    if sys.platform != "linux" or not status.exists():
        yield
        return
    size = int(re.search(r"VmSize:\s+(\d+) kB", status.read_text()).group(1)) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + headroom_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def allocation_failed(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is a failed allocation: load_checkpoint turns a reader's
    RuntimeError into a CheckpointError, so an allocation of the claimed size could hide behind a refusal."""
    while error is not None:
        if isinstance(error, MemoryError) or "can't allocate memory" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextmanager
def refused_without_allocating(match: str, headroom_mb: int = 512):
    """The block raises a CheckpointError matching `match`, having allocated less than `headroom_mb` on the way."""
    with address_space_limit(headroom_mb), pytest.raises(CheckpointError, match=match) as caught:
        yield
    assert not allocation_failed(caught.value), f"allocated what the file claims: {caught.value}"


def test_the_address_space_limit_makes_a_large_allocation_fail():
    with address_space_limit(512):
        if sys.platform == "linux":
            with pytest.raises(MemoryError):
                np.empty(2**33, np.uint8)
            with pytest.raises(RuntimeError, match="can't allocate memory") as caught:
                torch.empty(2**31)
            assert allocation_failed(caught.value) and not allocation_failed(CheckpointError("x", "y"))
    assert np.empty(2**30, np.uint8).nbytes == 2**30  # the limit is lifted after the block


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_every_registered_format_has_a_fuzz_sample():
    assert set(formats.FORMATS) <= {format for format, _ in SAMPLES}, "add the new format's sample to SAMPLES"


# --- specific defects, one format each where the defect belongs to it -----------------------------------------


@pytest.mark.parametrize("format", ["vitkit", "timm"])
def test_safetensors_header_claiming_more_data_than_the_file_holds_is_refused_without_allocating(tmp_path, format):
    path = tmp_path / "claims.safetensors"
    header = {"patch_embed.proj.weight": {"dtype": "F32", "shape": [2**31, 8], "data_offsets": [0, 2**36]}}
    if format == "vitkit":
        header["__metadata__"] = {"format": "vitkit", "config": json.dumps(TINY)}
    path.write_bytes(safetensors_bytes(header, b"\0" * 64))
    with refused_without_allocating(r"claims\.safetensors: not a readable safetensors file"):  # not 64 GiB
        vitkit.load_checkpoint(path, format=format)


def test_safetensors_with_a_duplicate_key_is_refused(tmp_path):
    entry = '{"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}'
    text = f'{{"pos_embed": {entry}, "pos_embed": {entry}}}'.encode()
    path = tmp_path / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 8)
    for format in ("timm", "vitkit", "auto"):
        with pytest.raises(CheckpointError, match=r"dup\.safetensors \[pos_embed\]: .* names this tensor twice"):
            vitkit.load_checkpoint(path, format=format)


def test_vitkit_file_whose_config_claims_a_huge_model_is_refused_before_building_it(tmp_path):
    path = tmp_path / "huge.safetensors"
    vitkit.export(tiny_model(), path)
    tensors = read_safetensors(path)[0]
    claimed = {**TINY, "hidden_size": 2**16, "num_heads": 1, "mlp_dim": 2**16, "num_layers": 10**6}
    save_file(tensors, str(path), metadata={"format": "vitkit", "config": json.dumps(claimed)})
    with refused_without_allocating(r"huge\.safetensors: the config claims at least [\d,]+ weights"):
        vitkit.load_checkpoint(path)


@pytest.mark.parametrize(
    "defect, message",
    [
        ("int", r"\[embedding\.weight\]: .*wrong shape or dtype .*torch\.int64"),
        ("missing", r"\[head\.bias\]: does not match its recorded config: missing \['head\.bias'\]"),
        ("extra", r"\[stray\]: does not match its recorded config: .*unexpected \['stray'\]"),
        ("shape", r"\[cls_token\]: does not match .*wrong shape"),
    ],
)
def test_vitkit_file_with_a_wrong_dtype_shape_or_key_names_the_key(tmp_path, defect, message):
    path = tmp_path / "model.safetensors"
    model = tiny_model()
    vitkit.export(model, path)
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    if defect == "int":
        tensors["embedding.weight"] = tensors["embedding.weight"].long()
    elif defect == "missing":
        del tensors["head.bias"]
    elif defect == "extra":
        tensors["stray"] = torch.zeros(2)
    else:
        tensors["cls_token"] = torch.zeros(1, 2, 16)
    metadata = {"format": "vitkit", "config": json.dumps(model.config.to_dict())}
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match=message):
        vitkit.load_checkpoint(path)


def test_timm_file_with_integer_weights_names_the_tensor(tmp_path):
    path = tmp_path / "timm.safetensors"
    vitkit.export(tiny_model(), path, format="timm")
    tensors, metadata = read_safetensors(path)
    tensors["blocks.0.norm1.weight"] = tensors["blocks.0.norm1.weight"].to(torch.int32)
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match=r"\[blocks\.0\.norm1\.weight\]: tensors of dtype torch\.int32"):
        vitkit.load_checkpoint(path)


def npy_member(archive: zipfile.ZipFile, name: str, header: dict, data: bytes) -> None:
    text = repr(header).encode()
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    archive.writestr(name, b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + data)


def test_npz_header_claiming_more_data_than_the_archive_holds_is_refused_without_allocating(tmp_path):
    path = tmp_path / "claims.npz"
    with zipfile.ZipFile(path, "w") as archive:
        npy_member(archive, "embedding/kernel.npy", {"descr": "<f4", "fortran_order": False, "shape": (10**11,)}, b"")
    with refused_without_allocating(r"claims\.npz \[embedding/kernel\]: the header claims shape"):
        vitkit.load_checkpoint(path)


def test_npz_with_a_duplicate_array_or_a_zip_bomb_is_refused(tmp_path):
    header = {"descr": "<f4", "fortran_order": False, "shape": (2,)}
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(tmp_path / "dup.npz", "w") as archive:
        npy_member(archive, "cls.npy", header, b"\0" * 8)
        npy_member(archive, "cls.npy", header, b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"dup\.npz \[cls\]: the archive holds this array twice"):
        vitkit.load_checkpoint(tmp_path / "dup.npz")
    with zipfile.ZipFile(tmp_path / "bomb.npz", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        npy_member(archive, "cls.npy", {**header, "shape": (2**21,)}, b"\0" * 2**23)
    with pytest.raises(CheckpointError, match=r"bomb\.npz \[cls\]: claims 8,388,736 bytes .* zip bomb"):
        vitkit.load_checkpoint(tmp_path / "bomb.npz")


def test_npz_missing_a_tensor_names_it(tmp_path):
    path = tmp_path / "official.npz"
    vitkit.export(tiny_model(), path, format="npz")
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files if k != "Transformer/encoder_norm/bias"}
    np.savez(path, **arrays)
    with pytest.raises(CheckpointError, match=r"\[Transformer/encoder_norm/bias\]: .*missing keys"):
        vitkit.load_checkpoint(path)


def test_torch_file_that_is_truncated_or_not_a_state_dict_is_refused(tmp_path):
    path = tmp_path / "model.pth"
    torch.save({"pos_embed": torch.zeros(3)}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"model\.pth: refused or unreadable as a weights-only torch file"):
        vitkit.load_checkpoint(path)
    torch.save({"pos_embed": [1, 2]}, path)
    with pytest.raises(CheckpointError, match=r"model\.pth: expected a flat state dict of named tensors"):
        vitkit.load_checkpoint(path)


def onnx_graph(path: Path, initializers: list) -> Path:
    """An ONNX file whose image input feeds a patch `Conv` reading the initializers W and B: enough of a graph for
    the loader to read its weights."""
    onnx = pytest.importorskip("onnx", reason="the ONNX format needs the optional dependency onnx (dev extra)")
    helper, T = onnx.helper, onnx.TensorProto
    conv = helper.make_node("Conv", ["pixel_values", "W", "B"], ["y"], kernel_shape=[8, 8], strides=[8, 8])
    image = helper.make_tensor_value_info("pixel_values", T.FLOAT, [1, 3, 16, 16])
    graph = helper.make_graph(
        [conv], "g", [image], [helper.make_tensor_value_info("y", T.FLOAT, None)], initializer=initializers
    )
    onnx.save(helper.make_model(graph), str(path))
    return path


def onnx_tensor(name: str, dims: list[int], raw: bytes | None = None, dtype: int = 1, external: dict | None = None):
    """An initializer (dtype 1: float32) with its data `raw`, or kept in another file as `external` says."""
    onnx = pytest.importorskip("onnx", reason="the ONNX format needs the optional dependency onnx (dev extra)")
    t = onnx.TensorProto(name=name, data_type=dtype, dims=dims)
    if raw is not None:
        t.raw_data = raw
    for key, value in (external or {}).items():
        t.data_location = onnx.TensorProto.EXTERNAL
        entry = t.external_data.add()
        entry.key, entry.value = key, str(value)
    return t


ONNX_WEIGHT = [16, 3, 8, 8]  # the patch Conv's kernel: 12,288 bytes of float32


@pytest.mark.parametrize(
    "defect, message",
    [
        ("int64", r"wrong\.onnx \[W\]: weights of dtype int64; a ViT's weights are floating point"),
        (
            "shape",
            r"wrong\.onnx \[W\]: the shape \[2147483648, 2147483648, 8, 8\] claims [\d,]+ bytes; the file "
            r"holds 64",
        ),
        ("negative", r"wrong\.onnx \[W\]: the shape \[-1\] has a negative dimension"),
        ("duplicate", r"wrong\.onnx \[B\]: the graph holds two initializers of this name"),
    ],
)
def test_onnx_initializer_of_a_wrong_dtype_absurd_shape_or_duplicate_name_is_refused_naming_it(
    tmp_path, defect, message
):
    bias = onnx_tensor("B", [16], bytes(64))
    weight = {
        "int64": onnx_tensor("W", ONNX_WEIGHT, bytes(8 * 3072), dtype=7),
        "shape": onnx_tensor("W", [2**31, 2**31, 8, 8], bytes(64)),
        "negative": onnx_tensor("W", [-1], bytes(64)),
        "duplicate": onnx_tensor("W", ONNX_WEIGHT, bytes(12288)),
    }[defect]
    path = onnx_graph(tmp_path / "wrong.onnx", [weight, bias] + ([bias] if defect == "duplicate" else []))
    with refused_without_allocating(message):
        vitkit.load_checkpoint(path)


@pytest.mark.parametrize(
    "external, message",
    [
        ({"location": "../outside.bin"}, r"'\.\./outside\.bin' must be a file in the model's own directory"),
        ({"location": "/etc/passwd"}, r"'/etc/passwd' must be a file in the model's own directory"),
        ({"location": "missing.bin"}, r"'missing\.bin' must be a file in the model's own directory"),
        ({"location": "w.bin", "length": 2**33}, r"8,589,934,592 bytes from offset 0 in a file of 1,024 bytes"),
        ({"location": "w.bin", "offset": 2**40, "length": 12288}, r"12,288 bytes from offset 1,099,511,627,776"),
        ({"location": "w.bin", "offset": "x"}, r"offset or length is not a number"),
    ],
)
def test_onnx_external_data_outside_the_directory_or_beyond_its_file_is_refused(tmp_path, external, message):
    (tmp_path / "outside.bin").write_bytes(bytes(2**14))  # a file that is there, but not the model's to read
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "w.bin").write_bytes(bytes(1024))
    weight = onnx_tensor(
        "W", ONNX_WEIGHT if "length" not in external else [external["length"] // 4], None, external=external
    )
    path = onnx_graph(tmp_path / "model" / "ext.onnx", [weight, onnx_tensor("B", [16], bytes(64))])
    with refused_without_allocating(rf"ext\.onnx \[W\]: .*{message}"):
        vitkit.load_checkpoint(path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": "abc"}, r"hf: the config inferred from the checkpoint is invalid"),
        ({"num_hidden_layers": 10**9}, r"hf: the config claims at least"),
        ({"image_size": 2**40}, r"hf: the config claims at least"),
        ({"id2label": {"x": "y"}}, r"hf: invalid literal"),
    ],
)
def test_hugging_face_config_with_absurd_values_is_refused(tmp_path, change, message):
    directory = tmp_path / "hf"
    vitkit.export(tiny_model(), directory, format="hf")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError, match=message):
        vitkit.load_checkpoint(directory)


@pytest.mark.parametrize("format", ["vitkit", "timm"])
def test_non_finite_weights_are_an_error_naming_the_tensors_unless_allowed(tmp_path, format):
    model = tiny_model()
    with torch.no_grad():
        model.blocks[0].mlp.fc1.weight[0, 0] = float("nan")
        model.head.bias[1] = float("inf")
    path = tmp_path / f"{format}.safetensors"
    vitkit.export(model, path, format=format)
    with pytest.raises(
        CheckpointError,
        match=r"non-finite weights .* in blocks\.0\.mlp\.fc1\.weight \(1 values\), "
        r"head\.bias \(1 values\).*allow_nonfinite=True",
    ):
        vitkit.load_checkpoint(path)
    with pytest.warns(UserWarning, match=r"non-finite weights .* blocks\.0\.mlp\.fc1\.weight"):
        loaded = vitkit.load_checkpoint(path, allow_nonfinite=True)
    assert torch.isnan(loaded.blocks[0].mlp.fc1.weight).sum() == 1


# --- fuzzing: every format of the registry, mutated at random ---------------------------------------------------


def tiny_dinov2():
    transformers = pytest.importorskip("transformers", reason="DINOv2 samples are made with transformers (dev extra)")
    config = transformers.Dinov2Config(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        mlp_ratio=2,
        image_size=16,
        patch_size=8,
        layerscale_value=0.5,
    )
    return transformers.Dinov2Model(config).eval()


def sample(format: str, name: str, directory: Path) -> Path:
    path = directory / name
    if format == "dinov2":  # load-only formats: made by the library whose files they are
        tiny_dinov2().save_pretrained(path)
    elif format == "onnx":
        pytest.importorskip("onnx", reason="the ONNX format needs the optional dependency onnx (dev extra)")
        path.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                tiny_dinov2(),
                (torch.randn(1, 3, 16, 16),),
                path,
                input_names=["pixel_values"],
                opset_version=14,
                dynamo=False,
            )
    elif path.suffix == ".pth":  # timm's pickled state dict, read weights-only
        vitkit.export(tiny_model(), path.with_suffix(".safetensors"), format=format)
        torch.save(read_safetensors(path.with_suffix(".safetensors"))[0], path)
        path.with_suffix(".safetensors").unlink()
    else:
        vitkit.export(tiny_model(), path, format=format)
    return path


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def json_values():
    scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
    containers = lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    return st.recursive(scalars, containers, max_leaves=6)


@st.composite
def mutations(draw, original: bytes):
    """A byte-level or structure-level change of a file: truncation, overwritten or inserted bytes, or (for a
    JSON file or a safetensors header) one JSON value replaced by an arbitrary one."""
    kind = draw(st.sampled_from(["truncate", "overwrite", "insert", "json"]))
    n = len(original)
    if kind == "truncate":
        return original[: draw(st.integers(0, n - 1))]
    if kind in ("overwrite", "insert"):
        at = draw(st.integers(0, n - 1))
        # Most of what matters sits in the first bytes (headers); aim there half of the time.
        at = draw(st.sampled_from([at, at % 256]))
        chunk = draw(st.binary(min_size=1, max_size=16))
        return original[:at] + chunk + original[at + (len(chunk) if kind == "overwrite" else 0) :]
    if original[:1] == b"{":
        start, text = 0, original
    elif n > 8 and original[8:9] == b"{":  # safetensors: 8-byte length, then the JSON header
        start, text = 8, original[8 : 8 + struct.unpack("<Q", original[:8])[0]]
    else:
        return original[::-1][:n]  # not JSON: a reversed file
    header = json.loads(text)
    path = [draw(st.sampled_from(sorted(header)))]
    node = header[path[0]]
    while isinstance(node, dict) and node and draw(st.booleans()):
        path.append(draw(st.sampled_from(sorted(node))))
        node = node[path[-1]]
    parent = header
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = draw(json_values())
    new = json.dumps(header).encode()
    if start == 0:
        return new
    return struct.pack("<Q", len(new)) + new + original[8 + len(text) :]


@pytest.mark.slow
@pytest.mark.parametrize("format, name", SAMPLES)
def test_fuzzed_checkpoints_raise_only_checkpoint_error(tmp_path_factory, format, name):
    base = tmp_path_factory.mktemp(f"fuzz-{format}")
    original = sample(format, name, base / "original")
    originals = {p.relative_to(original.parent): p.read_bytes() for p in files_of(original)}
    outcomes = {"loaded": 0, "refused": 0}

    @settings(
        max_examples=FUZZ_CASES, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(data=st.data())
    def check(data):
        target = data.draw(st.sampled_from(sorted(originals)), label="file")
        mutated = data.draw(mutations(originals[target]), label="mutation")
        work = base / "case"
        for name, content in originals.items():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_bytes(mutated if name == target else content)
        try:
            vitkit.load_checkpoint(work / original.name, format=format)
            outcomes["loaded"] += 1
        except CheckpointError as e:
            assert str(work) in str(e)  # names the file
            assert not allocation_failed(e), f"allocated what the file claims: {e}"
            outcomes["refused"] += 1

    with address_space_limit(1024):  # bounded memory: an allocation of 1 GiB or more fails, loudly
        check()
    print(f"{name}: {outcomes}")
    assert outcomes["refused"] > 100  # the mutations reached the readers


def test_hugging_face_shard_index_naming_a_file_outside_the_directory_or_a_key_twice_is_refused(tmp_path):
    directory = tmp_path / "hf"
    vitkit.export(tiny_model(), directory, format="hf")
    tensors = read_safetensors(directory / "model.safetensors")[0]
    (directory / "model.safetensors").unlink()
    save_file(tensors, str(directory / "a.safetensors"))
    save_file({"classifier.bias": tensors["classifier.bias"]}, str(directory / "b.safetensors"))
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    with pytest.raises(CheckpointError, match=r"index\.json: shards must be files of the directory itself"):
        vitkit.load_checkpoint(directory)
    index.write_text(json.dumps({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"b\.safetensors \[classifier\.bias\]: holds a tensor another shard"):
        vitkit.load_checkpoint(directory)
