"""The GPU-arch predicates (moe_verify/spec/arch.py), of a device and of a recorded major. The CPU
has no GPU, so the CUDA answers are stood in for: torch.cuda.is_available and
get_device_capability, as a Hopper or a Blackwell would give them."""

from __future__ import annotations

import pytest
import torch

from moe_verify.spec import arch

pytestmark = pytest.mark.cpu


def _gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> list[object]:
    """A CUDA GPU of `capability`; returns the devices its capability was asked for."""
    asked: list[object] = []

    def get_device_capability(device: object = None) -> tuple[int, int]:
        asked.append(device)
        return capability

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    return asked


def test_without_cuda_there_is_no_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in (None, 0, "cuda", torch.device("cuda:1"), "cpu"):
        assert arch.compute_capability(device) is None
        assert arch.cc_major(device) is None
        assert not arch.is_sm90(device)
        assert not arch.is_sm100(device)


@pytest.mark.parametrize(
    ("capability", "sm90", "sm100"),
    [
        ((9, 0), True, False),
        ((10, 0), False, True),
        ((8, 9), False, False),
        ((12, 0), False, False),
    ],
    ids=["hopper", "blackwell", "ada", "sm120"],
)
def test_the_major_decides(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], sm90: bool, sm100: bool
) -> None:
    _gpu(monkeypatch, capability)
    for device in (None, 0, "cuda:0", torch.device("cuda")):
        assert arch.compute_capability(device) == capability
        assert arch.cc_major(device) == capability[0]
        assert arch.is_sm90(device) is sm90
        assert arch.is_sm100(device) is sm100


def test_the_device_asked_about_is_the_one_given(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _gpu(monkeypatch, (9, 0))
    arch.cc_major(torch.device("cuda:1"))
    arch.cc_major(None)
    arch.cc_major(3)
    assert asked == [torch.device("cuda:1"), None, 3]


def test_a_device_off_cuda_has_no_arch_even_beside_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU tensor's device on a GPU machine: the GPU's arch says nothing about where it lives."""
    asked = _gpu(monkeypatch, (9, 0))
    for device in ("cpu", torch.device("cpu"), torch.device("meta")):
        assert arch.cc_major(device) is None
        assert not arch.is_sm90(device)
    assert asked == []


@pytest.mark.parametrize(
    ("major", "sm90", "sm100"),
    [
        (9, True, False),  # Hopper
        (10, False, True),  # Blackwell datacenter
        (None, False, False),  # no GPU: no arch, not an error
        (8, False, False),  # Ada / Ampere: below SM90
        (11, False, False),  # between: not SM100 "or newer"
        (12, False, False),  # SM120 (consumer Blackwell): not SM100
    ],
    ids=["9", "10", "none", "8", "11", "12"],
)
def test_a_major_is_sm90_or_sm100_exactly(major: int | None, sm90: bool, sm100: bool) -> None:
    """The probe's recorded major (DeepGemmStatus.arch_major) answers as a device does."""
    assert arch.is_sm90_major(major) is sm90
    assert arch.is_sm100_major(major) is sm100
