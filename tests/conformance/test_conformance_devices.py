"""A device a framework cannot run a conformance check on is refused before any work
(issue 48, item 6): ``device="mps"`` or ``"meta"`` with PyTorch used to run and report the
implementation as failing, and JAX took ``device=""`` as its default device.

:func:`refdml.conformance._frameworks.check_device` states the devices of each framework
without importing it, so its table is tested here on every machine; the frameworks' own
availability checks are tested where the framework is installed (``importorskip``).
"""

from __future__ import annotations

import numpy as np
import pytest

from refdml.cli import main
from refdml.conformance import check_implementation
from refdml.conformance._frameworks import DEVICES, FRAMEWORKS, check_device, get_framework

_ACCEPTED = {
    "numpy": ["cpu"],
    "torch": ["cpu", "cuda", "cuda:0", "cuda:12"],
    "jax": ["cpu", "gpu", "cuda", "tpu"],
    "cupy": ["cuda", "cuda:0", "cuda:3", "gpu"],
}
_REFUSED = {
    "numpy": ["", "cuda", "gpu", "CPU", "cpu:0", " cpu", "meta"],
    "torch": ["", "mps", "meta", "xla", "xpu", "cuda:", "cuda:x", "cuda:-1", "CUDA", "cpu ",
              "gpu", "tpu"],
    "jax": ["", "mps", "meta", "gpu:0", "warp", " cpu", "tpu9"],
    "cupy": ["", "cpu", "mps", "meta", "cuda:", "cuda:x"],
}


def test_every_framework_states_its_devices():
    assert sorted(DEVICES) == sorted(FRAMEWORKS) == sorted(_ACCEPTED) == sorted(_REFUSED)


@pytest.mark.parametrize(("framework", "device"),
                         [(f, d) for f, ds in _ACCEPTED.items() for d in ds])
def test_a_supported_device_passes_as_written(framework, device):
    assert check_device(framework, device) == device
    assert check_device(framework, None) is None


@pytest.mark.parametrize(("framework", "device"),
                         [(f, d) for f, ds in _REFUSED.items() for d in ds])
def test_an_unsupported_device_is_refused_naming_it_and_what_is_supported(framework, device):
    with pytest.raises(ValueError) as error:
        check_device(framework, device)
    message = str(error.value)
    assert message.startswith(f"device == {device!r}, must be None")
    assert f"for framework {framework!r}" in message
    for supported in DEVICES[framework]:
        assert repr(supported) in message


@pytest.mark.parametrize("device", [0, 1.5, True, b"cpu", ["cpu"]])
def test_a_device_that_is_not_a_string_is_a_type_error(device):
    with pytest.raises(TypeError, match="device must be None or a string"):
        check_device("torch", device)


def _never_called(**kwargs):
    raise AssertionError("the implementation ran")


@pytest.mark.parametrize(("framework", "device"),
                         [("torch", "mps"), ("torch", "meta"), ("jax", ""), ("jax", "mps")])
def test_check_implementation_refuses_the_device_before_any_work(framework, device):
    # before importing the framework too: the same answer whether it is installed or not
    with pytest.raises(ValueError, match=f"^device == {device!r}, must be None"):
        check_implementation(_never_called, "normalize.l2_normalize", framework=framework,
                             device=device, seeds=1, search=False)


def test_conform_refuses_the_device_in_one_line_with_exit_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "mine_devices.py").write_text("def f(**kwargs):\n    raise AssertionError\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    status = main(["conform", "mine_devices:f", "--op", "normalize.l2_normalize",
                   "--framework", "torch", "--device", "mps"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "--device mps" in lines[0] and "'cuda:N'" in lines[0]


def test_torch_refuses_meta_mps_and_an_absent_cuda_device():
    torch = pytest.importorskip("torch")
    for device in ("meta", "mps"):
        with pytest.raises(ValueError, match=f"device == '{device}'"):
            get_framework("torch", device=device)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"device == 'cuda:{count}'"):
        get_framework("torch", device=f"cuda:{count}")
    assert str(get_framework("torch", device="cpu").device) == "cpu"


def test_jax_refuses_the_empty_device():
    pytest.importorskip("jax")
    with pytest.raises(ValueError, match="device == ''"):
        get_framework("jax", device="")
    assert get_framework("jax", device="cpu").device.platform == "cpu"


def test_numpy_still_runs_on_its_one_device():
    framework = get_framework("numpy", backward=lambda ctx, *c: {}, device="cpu")
    assert framework.asarray(np.ones(2), None).dtype == np.float64
