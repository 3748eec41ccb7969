"""Selecting one GPU by NVML index, UUID or PCI bus id. Pure parsing."""

from __future__ import annotations

from dataclasses import dataclass


def normalize_pci_bus_id(value: str) -> str | None:
    """``[domain:]bus:device.function`` (hex) → NVML's ``00000000:01:00.0`` form, lowercase.

    Returns None when ``value`` is not a PCI bus id.
    """
    parts = value.strip().lower().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3 or "." not in parts[2]:
        return None
    device, _, function = parts[2].partition(".")
    try:
        domain, bus, dev, fn = (int(p, 16) for p in (parts[0], parts[1], device, function))
    except ValueError:
        return None
    if domain > 0xFFFFFFFF or bus > 0xFF or dev > 0x1F or fn > 0x7:
        return None
    return f"{domain:08x}:{bus:02x}:{dev:02x}.{fn:x}"


@dataclass(frozen=True, slots=True)
class GpuSelector:
    """Which GPU a resource means: ``kind`` is "index", "uuid" or "pci"."""

    kind: str
    value: str

    @classmethod
    def parse(cls, device: int | str | None) -> GpuSelector:
        """From the ``device`` config key; raises ValueError for something that is none of them."""
        if device is None:
            return cls("index", "0")
        if isinstance(device, int):
            if device < 0:
                raise ValueError("a GPU index is 0 or more")
            return cls("index", str(device))
        text = device.strip()
        if text.isdigit():
            return cls("index", str(int(text)))
        if text.upper().startswith(("GPU-", "MIG-")) and len(text) > 4:
            return cls("uuid", text)
        pci = normalize_pci_bus_id(text)
        if pci is not None:
            return cls("pci", pci)
        raise ValueError(
            f"device {device!r} is not an index, a GPU UUID (GPU-…) or a PCI bus id (0000:01:00.0)"
        )

    def matches(self, index: int, uuid: str, pci_bus_id: str) -> bool:
        if self.kind == "index":
            return index == int(self.value)
        if self.kind == "uuid":
            return uuid.lower() == self.value.lower()
        return normalize_pci_bus_id(pci_bus_id) == self.value

    def __str__(self) -> str:
        return self.value if self.kind != "index" else f"index {self.value}"
