"""One backend registry for every op: named implementations, availability, and the ``"auto"`` choice per device.

Each op (``projected_value_norm``, ``ragged_attention``) owns an :class:`OpRegistry`. A backend is picked
explicitly by name (one that cannot run is an error saying how to get it) or by ``"auto"``: the first backend of
the op's preference order for the tensors' device that is available and accepts the inputs, with one warning per
(device, choice) when a preferred backend had to be skipped. ``$<env_var>`` replaces ``"auto"`` when set.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger(__name__)


class BackendUnavailableError(RuntimeError):
    """A backend was requested explicitly but cannot run here (or cannot run these inputs)."""


@dataclass(frozen=True)
class Backend:
    """
    One implementation of an op.

    Parameters
    ----------
    name : str
        Name users pass as ``backend=``.
    fn : callable
        The implementation, with the op's signature.
    devices : tuple of str, or callable returning one
        Device types (``"cpu"``, ``"cuda"``) it runs on; a callable when this depends on the environment (Triton
        admits CPU tensors only while its interpreter is on).
    availability : callable
        ``availability() -> None`` when usable, else a sentence saying why not and how to fix it.
    supports : callable, optional
        ``supports(*inputs) -> None`` when it can run these inputs, else why not (e.g. flash-attn runs fp16/bf16
        only). Called with the op's tensor arguments.
    """

    name: str
    fn: Callable
    devices: tuple[str, ...] | Callable[[], tuple[str, ...]]
    availability: Callable[[], str | None]
    supports: Callable[..., str | None] | None = None

    def device_types(self) -> tuple[str, ...]:
        """Device types the backend accepts now."""
        return self.devices() if callable(self.devices) else self.devices

    def refusal(self, *inputs) -> str | None:
        """Why this backend cannot run ``inputs`` (None when it can)."""
        return None if self.supports is None else self.supports(*inputs)


class OpRegistry:
    """
    The backends of one op and its ``"auto"`` preference order per device type.

    Parameters
    ----------
    op : str
        Name of the op, for messages.
    auto_order : dict
        Device type -> backend names in order of preference (names not registered are skipped).
    legacy_env_var : str, optional
        An earlier name of the op's environment variable, still honoured (with one warning).
    input_order : callable, optional
        ``(device_type, *inputs) -> tuple of names or None``: a preference order for these inputs (for example,
        another backend is faster for multi-token queries); None keeps ``auto_order``. Skipping a backend this way
        is a preference, not a fallback: no warning.
    """

    def __init__(self, op: str, auto_order: dict[str, tuple[str, ...]], input_order=None, legacy_env_var=None):
        self.op = op
        self.auto_order = auto_order
        self.env_var = f"KVPRESS_CRITICAL_{op.upper()}_BACKEND"  # one scheme for every op
        self.legacy_env_var = legacy_env_var
        self.input_order = input_order
        self.backends: dict[str, Backend] = {}
        self.warned: set[tuple[str, str]] = set()

    def register(self, backend: Backend) -> None:
        """Register (or replace) a backend under ``backend.name``."""
        self.backends[backend.name] = backend

    def names(self) -> tuple[str, ...]:
        """Names of all registered backends, available here or not."""
        return tuple(self.backends)

    def available(self, device: str | torch.device | None = None) -> list[str]:
        """Backends usable in this environment, optionally restricted to a device type."""
        device_type = None if device is None else torch.device(device).type
        return [
            name
            for name, b in self.backends.items()
            if b.availability() is None and (device_type is None or device_type in b.device_types())
        ]

    def check_name(self, backend: str) -> None:
        """Raise if ``backend`` is neither ``"auto"`` nor a usable registered backend."""
        if backend == "auto":
            return
        if backend not in self.backends:
            raise ValueError(
                f"unknown backend {backend!r} of {self.op}; choose 'auto' or one of {sorted(self.backends)}"
            )
        reason = self.backends[backend].availability()
        if reason is not None:
            raise BackendUnavailableError(f"{self.op} backend {backend!r} is not available: {reason}")

    def resolve(self, backend: str, device: torch.device, *inputs) -> str:
        """
        The backend that will run for ``backend`` on ``device`` (and ``inputs``, when given).

        ``"auto"`` (or ``$env_var``) walks the preference order; an explicit name that cannot run is an error.
        """
        if backend == "auto":
            backend = self.environment_choice()
        if backend != "auto":
            self.check_name(backend)
            chosen = self.backends[backend]
            if device.type not in chosen.device_types():
                raise BackendUnavailableError(
                    f"{self.op} backend {backend!r} runs on {list(chosen.device_types())}, but the inputs are on "
                    f"{device.type!r}; use backend='auto' or one of {self.available(device)}"
                )
            refusal = chosen.refusal(*inputs) if inputs else None
            if refusal is not None:
                raise BackendUnavailableError(f"{self.op} backend {backend!r} cannot run these inputs: {refusal}")
            return backend
        skipped = []
        order = self.input_order(device.type, *inputs) if self.input_order is not None and inputs else None
        for name in order or self.auto_order.get(device.type, ("torch",)):
            b = self.backends.get(name)
            if b is None or device.type not in b.device_types():
                continue
            reason = b.availability() or (b.refusal(*inputs) if inputs else None)
            if reason is None:
                if skipped and (device.type, name) not in self.warned:
                    self.warned.add((device.type, name))
                    logger.warning(
                        "%s on %s: using backend %r because %s",
                        self.op,
                        device.type,
                        name,
                        "; ".join(f"{n!r} is not available ({r})" for n, r in skipped),
                    )
                return name
            skipped.append((name, reason))
        return "torch"

    def environment_choice(self) -> str:
        """The backend ``$<env_var>`` names (``"auto"`` when unset); the legacy name counts too, with one warning."""
        choice = os.environ.get(self.env_var)
        if choice is None and self.legacy_env_var and self.legacy_env_var in os.environ:
            choice = os.environ[self.legacy_env_var]
            if ("env", self.legacy_env_var) not in self.warned:
                self.warned.add(("env", self.legacy_env_var))
                logger.warning("$%s is now $%s (the old name still works)", self.legacy_env_var, self.env_var)
        return choice or "auto"

    def __getitem__(self, name: str) -> Backend:
        return self.backends[name]
