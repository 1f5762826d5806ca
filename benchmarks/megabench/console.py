"""What the benchmark prints: its progress lines and byte sizes as the lines and the tables write them."""

from __future__ import annotations


def say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
