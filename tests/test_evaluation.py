"""Few-shot linear evaluation: the closed form against numpy's least squares, and determinism for a seed; the linear
probe that starts a fine-tuning head, against scikit-learn's logistic regression."""

import numpy as np
import pytest
import torch

import vitkit
from vitkit.data.datasets import ImageArrayDataset
from vitkit.training.evaluation import features, fewshot, least_squares_fit, least_squares_predict, probe_head


def test_least_squares_fit_matches_numpy_ridge_regression():
    rng = np.random.default_rng(0)
    x, y, l2 = rng.normal(size=(12, 5)), rng.integers(0, 3, 12), 0.7
    w = least_squares_fit(torch.from_numpy(x), torch.from_numpy(y), 3, l2)
    # Independent form: ridge = plain least squares on the system stacked with sqrt(l2) * I and zero targets.
    x1 = np.concatenate([x, np.ones((12, 1))], 1)
    targets = 2 * np.eye(3)[y] - 1
    stacked_x = np.concatenate([x1, np.sqrt(l2) * np.eye(6)])
    stacked_t = np.concatenate([targets, np.zeros((6, 3))])
    expected = np.linalg.lstsq(stacked_x, stacked_t, rcond=None)[0]
    np.testing.assert_allclose(w.numpy(), expected, atol=1e-10)


def _split(seed: int, per_class: int, classes: int = 3) -> ImageArrayDataset:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(per_class)
    images = torch.randint(0, 256, (len(labels), 1, 8, 8), dtype=torch.uint8, generator=g)
    images[:, :, :4] = (labels * 100)[:, None, None, None].to(torch.uint8)  # a class cue in the top half
    return ImageArrayDataset(images, labels, [str(c) for c in range(classes)])


@pytest.fixture
def tiny_vit():
    return vitkit.create_model(
        "ViT-Ti/4", image_size=8, in_chans=1, num_classes=3, hidden_size=16, num_layers=1, mlp_dim=16, num_heads=2
    ).eval()


def test_fewshot_with_every_training_image_equals_numpy_on_the_features(tiny_vit):
    train_set, test_set = _split(0, per_class=4), _split(1, per_class=5)
    result = fewshot(tiny_vit, train_set, test_set, shots=(4,), draws=2, l2=0.5, seed=3)
    x = features(tiny_vit, train_set, list(range(12))).numpy()
    xt = features(tiny_vit, test_set, list(range(15))).numpy()
    x1, xt1 = np.concatenate([x, np.ones((12, 1))], 1), np.concatenate([xt, np.ones((15, 1))], 1)
    t = 2 * np.eye(3)[train_set.labels.numpy()] - 1
    w = np.linalg.solve(x1.T @ x1 + 0.5 * np.eye(x1.shape[1]), x1.T @ t)
    expected = float(((xt1 @ w).argmax(1) == test_set.labels.numpy()).mean())
    assert result.per_draw[4] == pytest.approx([expected, expected], abs=1e-12)  # all 4 shots: every draw is the same
    assert 0 <= least_squares_predict(torch.from_numpy(w), torch.from_numpy(xt)).min()


def test_fewshot_is_deterministic_for_a_seed_and_draws_differ(tiny_vit):
    train_set, test_set = _split(0, per_class=10), _split(1, per_class=10)
    a = fewshot(tiny_vit, train_set, test_set, shots=(1, 3), draws=4, seed=7)
    b = fewshot(tiny_vit, train_set, test_set, shots=(1, 3), draws=4, seed=7)
    c = fewshot(tiny_vit, train_set, test_set, shots=(1, 3), draws=4, seed=8)
    assert a.per_draw == b.per_draw and a.per_draw != c.per_draw
    assert set(a.accuracy) == {1, 3} and len(set(a.per_draw[1])) > 1  # draws really differ
    assert a.accuracy[1] == pytest.approx(sum(a.per_draw[1]) / 4)


def test_fewshot_refuses_more_shots_than_the_rarest_class_has(tiny_vit):
    with pytest.raises(ValueError, match="1 <= shots <= 4"):
        fewshot(tiny_vit, _split(0, per_class=4), _split(1, per_class=2), shots=(5,))


def test_cli_eval_fewshot_prints_each_shot(tmp_path, capsys, tiny_vit):
    from vitkit.cli.parser import main

    model = vitkit.create_model(
        "ViT-Ti/8", image_size=16, num_classes=6, hidden_size=16, num_layers=1, mlp_dim=16, num_heads=2
    )
    vitkit.export(model, tmp_path / "m.safetensors")
    args = ["eval", "--checkpoint", str(tmp_path / "m.safetensors"), "--data", "shapes", "--fewshot", "1,2"]
    assert main([*args, "--draws", "2"]) == 0
    out = capsys.readouterr().out
    assert "1-shot" in out and "2-shot" in out
    assert main([*args[:-1], "1,x"]) == 2


def test_evaluate_matches_the_datasets_classes_to_the_models_by_name_and_warns_where_they_differ(tiny_vit):
    """A model trained with its classes in another order (a built-in dataset's, unsorted) scores each image against
    its own class, the same as on the dataset relabelled by hand; other names are compared by position, with a
    warning; a model without class names is scored on the labels as they are."""
    split = _split(0, per_class=4)  # classes "0", "1", "2"
    torch.manual_seed(0)
    torch.nn.init.normal_(tiny_vit.head.weight, std=1.0)  # predictions that differ between images
    tiny_vit.class_names = ["2", "0", "1"]
    got = vitkit.evaluate(tiny_vit, split)
    mapping = torch.tensor([1, 2, 0])  # the dataset's label -> the model's
    relabelled = ImageArrayDataset(split.images, mapping[split.labels], ["2", "0", "1"])
    tiny_vit.class_names = None
    want = vitkit.evaluate(tiny_vit, relabelled)
    assert got.classes_matched == "by name" and torch.equal(got.confusion, want.confusion)
    assert got.confusion.sum(1).tolist() == [4, 4, 4] and want.classes_matched == "same"
    as_given = vitkit.evaluate(tiny_vit, split)
    assert as_given.classes_matched == "same" and not torch.equal(as_given.confusion, got.confusion)
    tiny_vit.class_names = ["a", "b", "c"]
    with pytest.warns(UserWarning, match=r"the dataset's classes \(0, 1, 2\) are not the model's \(a, b, c\)"):
        renamed = vitkit.evaluate(tiny_vit, split)
    assert renamed.classes_matched == "by position" and torch.equal(renamed.confusion, as_given.confusion)


def test_probe_head_is_scikit_learns_logistic_regression_on_the_frozen_features(tiny_vit):
    sklearn = pytest.importorskip("sklearn.linear_model", reason="the reference is scikit-learn (dev extra)")
    train_set = _split(0, per_class=10)
    x = features(tiny_vit, train_set, list(range(len(train_set)))).numpy()
    tiny_vit.reset_head(3)
    accuracy = probe_head(tiny_vit, train_set, c=0.5)
    reference = sklearn.LogisticRegression(C=0.5, tol=1e-10, max_iter=10_000).fit(x, train_set.labels.numpy())
    with torch.no_grad():
        probabilities = tiny_vit.head(torch.from_numpy(x).float()).softmax(1).numpy()
    # the same penalised likelihood, fitted to convergence: the same probabilities (an fp32 head: 1e-4)
    np.testing.assert_allclose(probabilities, reference.predict_proba(x), atol=1e-4)
    assert accuracy == pytest.approx(reference.score(x, train_set.labels.numpy()))
    assert tiny_vit.training is False  # left as it was: in eval mode here
