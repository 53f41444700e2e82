"""ASAP (Alg. 1 and 2) wired into a run: the trainer's problem-instance hook, the proxies'
re-initialisation against ``select_proxies``, the optimiser reset, bit-for-bit resume across
an instance boundary, and ``refdml train`` with ``objective = "asap"`` logging the radius.

The digits-collage runs are tiny (2-3 channels, 4-d embeddings, 2 proxies per class)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from refdml.cli import main
from refdml.kcenter import select_proxies
from refdml.train._parameter import Parameter
from refdml.train.optim import SGD, Adam
from refdml.train.runs import build_run, effective_config

ASAP = dict(conv_channels=[2, 3], local_dim=4, n_prototypes=3, embedding_dim=4,
            n_samples_per_class=4, lr=1e-2, progress=False, head="gap", objective="asap",
            proxies_per_class=2, budget=3, asap_lambda=1e-3, instance_every=2,
            plateau_factor=None, early_stopping_patience=None, early_stopping_target=None)


def _tiny(tmp_path, epochs, **kw):
    run = build_run("digits-collage", dict(ASAP, epochs=epochs, **kw), out_dir=tmp_path)
    # few steps per epoch: keep the tests fast
    t = run.trainer
    keep = np.concatenate([np.flatnonzero(t.train_y == c)[:12] for c in np.unique(t.train_y)])
    t.train_x, t.train_y = t.train_x[keep], t.train_y[keep]
    from refdml.train.data import PKBatchSampler
    t.train_sampler = PKBatchSampler(t.train_y, n_classes_per_batch=8, n_samples_per_class=4,
                                     rng=3)
    t.val_x, t.val_y, t.test_x, t.test_y = t.val_x[:40], t.val_y[:40], t.test_x[:40], t.test_y[:40]
    return run


def test_config_defaults_and_errors():
    c = effective_config("digits-collage", {"objective": "asap"})
    assert (c["proxies_per_class"], c["budget"], c["asap_lambda"]) == (8, 12, 2e-4)
    assert c["loss"] == "proxy_nca" and c["zero_shot"] is False
    with pytest.raises(ValueError, match="proxy loss"):
        effective_config("digits-collage", {"objective": "asap", "loss": "contrastive"})
    with pytest.raises(ValueError, match="apply to objective == 'asap'"):
        effective_config("digits-collage", {"budget": 4})
    with pytest.raises(ValueError, match="budget"):
        effective_config("digits-collage", {"objective": "asap", "budget": 2,
                                            "proxies_per_class": 3})
    with pytest.raises(ValueError, match="zero-shot"):
        effective_config("digits-collage", {"objective": "asap", "zero_shot": True})


def test_hook_epochs_proxies_and_optimizer_reset(tmp_path):
    run = _tiny(tmp_path, epochs=5)
    t, obj = run.trainer, run.objective
    assert [e for e in range(1, 8) if t.instance_due(e)] == [1, 3, 5, 7]
    calls = []
    original = t.new_problem_instance

    def spy(epoch):
        # the oracle: the same pools (a copy of the trainer's rng) through select_proxies
        rng = np.random.default_rng()
        rng.bit_generator.state = t.rng.bit_generator.state
        emb = np.asarray(t.embed(t.train_x), dtype=np.float64)
        before = np.array(obj.proxies.value, dtype=np.float64, copy=True)
        expected = select_proxies(emb, t.train_y, before, np.asarray(obj.proxy_labels),
                                  budget=obj.budget, rng=rng)
        n_steps = t.optimizer.n_steps
        result = original(epoch)
        calls.append(epoch)
        np.testing.assert_array_equal(obj.proxies.value, expected.proxies.astype(
            obj.proxies.value.dtype))
        np.testing.assert_array_equal(result.indices, expected.indices)
        for name, buf in t.optimizer._buffers[obj.proxies.name].items():
            assert not np.any(buf), name
        assert t.optimizer._step_offsets[obj.proxies.name] == n_steps
        for p, star in zip(obj.model_parameters, obj.theta_star):
            np.testing.assert_array_equal(p.value, star)
        if epoch > 1:   # the model's moments are kept
            model_param = obj.model_parameters[0]
            assert np.any(t.optimizer._buffers[model_param.name]["exp_avg"])
        return result

    t.new_problem_instance = spy
    rows = t.fit()
    assert calls == [1, 3, 5]
    radii = [r["proxy_covering_radius"] for r in rows]
    assert len(radii) == 6 and all(np.isfinite(radii)) and all(0 <= r <= 2 for r in radii)


def test_covering_radius_is_a_loop(tmp_path):
    run = _tiny(tmp_path, epochs=0)
    obj, t = run.objective, run.trainer
    emb = np.asarray(t.embed(t.train_x), dtype=np.float64)
    p = np.asarray(obj.proxies.value, dtype=np.float64)
    p = p / np.linalg.norm(p, axis=1, keepdims=True)
    worst = 0.0
    for e, y in zip(emb, t.train_y):
        own = [np.linalg.norm(e - q) for q, c in zip(p, obj.proxy_labels) if c == y]
        worst = max(worst, min(own))
    assert obj.covering_radius(emb, t.train_y) == pytest.approx(worst, rel=1e-12)


def test_optimizer_reset_state():
    rng = np.random.default_rng(0)
    a = Parameter(rng.normal(size=3), "a")
    b = Parameter(rng.normal(size=3), "b")
    fresh = Parameter(np.zeros(3), "fresh")
    opt = Adam([a, b], lr=0.1)
    for _ in range(5):
        a.grad[...] = rng.normal(size=3)
        b.grad[...] = rng.normal(size=3)
        opt.step()
    b_buffers = {k: v.copy() for k, v in opt._buffers["b"].items()}
    opt.reset_state([a])
    assert not any(np.any(v) for v in opt._buffers["a"].values())
    for k, v in b_buffers.items():
        np.testing.assert_array_equal(opt._buffers["b"][k], v)
    # after the reset, a steps as with a freshly built Adam (bias correction from step 1)
    a.value[...] = 0.0
    ref = Adam([fresh], lr=0.1)
    g = rng.normal(size=3)
    a.grad[...] = g
    b.grad[...] = g
    fresh.grad[...] = g
    opt.step()
    ref.step()
    np.testing.assert_array_equal(a.value, fresh.value)
    # the offset survives a state_dict round trip
    state = opt.state_dict()
    assert state["params"]["a"]["step_offset"] == 5 and "step_offset" not in state["params"]["b"]
    other = Adam([Parameter(a.value.copy(), "a"), Parameter(b.value.copy(), "b")], lr=0.1)
    other.load_state_dict(state)
    assert other._step_offsets == {"a": 5, "b": 0}
    sgd = SGD([a], lr=0.1, momentum=0.9)
    a.grad[...] = 1.0
    sgd.step()
    sgd.reset_state([a])
    assert not np.any(sgd._buffers["a"]["velocity"])
    with pytest.raises(ValueError, match="not a parameter"):
        opt.reset_state([fresh])


def test_resume_across_an_instance_boundary_is_bit_for_bit(tmp_path):
    whole = _tiny(tmp_path / "whole", epochs=4)
    whole.trainer.fit()
    part = _tiny(tmp_path / "part", epochs=2)
    part.trainer.fit()       # stops after epoch 2; epoch 3 starts an instance
    resumed = _tiny(tmp_path / "part", epochs=4)
    resumed.trainer.resume()
    resumed.trainer.fit()
    for name, p in whole.trainer.parameters.items():
        np.testing.assert_array_equal(p.value, resumed.trainer.parameters[name].value, name)
    for x, y in zip(whole.objective.theta_star, resumed.objective.theta_star):
        np.testing.assert_array_equal(x, y)

    def rows(path):
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
                for line in (path / "log.jsonl").read_text().splitlines()]

    assert rows(tmp_path / "whole") == rows(tmp_path / "part")


def test_cli_digits_collage_asap(tmp_path):
    cfg = tmp_path / "run.toml"
    c = dict(ASAP, collages_per_image=1)
    c.pop("progress")
    c.pop("plateau_factor")
    c.pop("early_stopping_patience")
    c.pop("early_stopping_target")
    lines = [f"{k} = {json.dumps(v)}" for k, v in c.items()]
    cfg.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    assert main(["train", "--study", "digits-collage", "--config", str(cfg), "--out", str(out),
                 "--epochs", "2"]) == 0
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert all(np.isfinite(r["proxy_covering_radius"]) for r in rows)
    config = json.loads((out / "config.json").read_text())
    assert config["instance_every"] == 2 and config["run"]["objective"] == "asap"


def _scripted_validation(run, script):
    """The trainer's validation MAP@R of epoch ``e`` is ``script[e]`` (the epoch evaluated
    is 0 before the run started, else the last finished one + 1)."""
    t = run.trainer
    t._evaluation = lambda: {"val_map_at_r": script[t.epoch + int(t.started)]}
    return run


def test_resume_keeps_the_instance_patience_bookkeeping(tmp_path):
    """instance_patience = 1 on a scripted validation curve: epoch 2 does not beat epoch 1
    (instance at 3), 4 ties 3 (instance at 5), 5 falls (instance at 6). The interrupted run
    stops after epoch 4 with the instance of epoch 5 decided but not started: the resumed
    run must start it, as the uninterrupted one does."""
    script = [0.10, 0.20, 0.15, 0.30, 0.30, 0.10, 0.20]
    kw = dict(instance_every=None, instance_patience=1)
    whole = _scripted_validation(_tiny(tmp_path / "whole", epochs=6, **kw), script)
    whole.trainer.fit()
    assert whole.trainer.instance_starts == [1, 3, 5, 6]
    part = _scripted_validation(_tiny(tmp_path / "part", epochs=4, **kw), script)
    part.trainer.fit()
    assert part.trainer.instance_starts == [1, 3] and part.trainer.next_instance_epoch == 5
    resumed = _scripted_validation(_tiny(tmp_path / "part", epochs=6, **kw), script)
    resumed.trainer.resume()
    assert resumed.trainer.instance_starts == [1, 3]
    assert (resumed.trainer.instance_best_metric, resumed.trainer.instance_best_epoch,
            resumed.trainer.next_instance_epoch) == (0.30, 4, 5)
    resumed.trainer.fit()
    assert resumed.trainer.instance_starts == [1, 3, 5, 6]
    for name, p in whole.trainer.parameters.items():
        np.testing.assert_array_equal(p.value, resumed.trainer.parameters[name].value, name)

    def rows(path):
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
                for line in (path / "log.jsonl").read_text().splitlines()]

    assert rows(tmp_path / "whole") == rows(tmp_path / "part")
    assert [r["instance"] for r in rows(tmp_path / "whole")] == [0, 1, 1, 2, 2, 3, 4]
    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert config["instance_patience"] == 1 and config["instance_every"] is None
    assert config["run"]["instance_patience"] == 1


def test_config_instance_patience_replaces_instance_every():
    c = effective_config("digits-collage", {"objective": "asap", "instance_patience": 3})
    assert (c["instance_patience"], c["instance_every"]) == (3, None)
    c = effective_config("glyphs", {"objective": "asap"})
    assert (c["instance_patience"], c["instance_every"]) == (None, 3)     # as before
    with pytest.raises(ValueError, match=r"instance_every == 2 and instance_patience == 3"):
        effective_config("digits-collage", {"objective": "asap", "instance_every": 2,
                                            "instance_patience": 3})
    with pytest.raises(ValueError, match="apply to objective == 'asap'"):
        effective_config("digits-collage", {"instance_patience": 3})
    with pytest.raises(ValueError, match="instance_every or instance_patience"):
        effective_config("digits-collage", {"objective": "asap", "instance_every": None})
    with pytest.raises(ValueError, match=r"instance_patience == 0"):
        effective_config("digits-collage", {"objective": "asap", "instance_patience": 0})


def test_a_run_folder_from_before_instance_patience_resumes(tmp_path):
    """config.json written before the key existed (no instance_patience anywhere, no
    instance bookkeeping in the checkpoint) resumes, its instance starts rebuilt from
    instance_every, as the uninterrupted run has them."""
    from refdml.train._checkpoint import load_checkpoint, save_checkpoint

    whole = _tiny(tmp_path / "whole", epochs=4)
    whole.trainer.fit()
    part = _tiny(tmp_path / "part", epochs=3)
    part.trainer.fit()
    path = tmp_path / "part" / "config.json"
    config = json.loads(path.read_text())
    del config["run"]["instance_patience"]
    path.write_text(json.dumps(config))
    parameters, optimizer_state, meta = load_checkpoint(tmp_path / "part" / "checkpoint.npz")
    del meta["instance_starts"]
    save_checkpoint(tmp_path / "part" / "checkpoint.npz", parameters=parameters,
                    optimizer_state=optimizer_state, meta=meta)
    resumed = _tiny(tmp_path / "part", epochs=4)
    resumed.trainer.resume()
    assert resumed.trainer.instance_starts == [1, 3]
    resumed.trainer.fit()
    assert resumed.trainer.instance_starts == whole.trainer.instance_starts == [1, 3]
    for name, p in whole.trainer.parameters.items():
        np.testing.assert_array_equal(p.value, resumed.trainer.parameters[name].value, name)
