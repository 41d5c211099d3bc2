"""Labels as a streamed source gives them, a sample (or a batch) at a time: class indices or
class names, never a mix. Names get provisional numbers in the order first seen and are sorted
at the end; indices are kept as given, below a fixed list of names when the source has one
(a Hugging Face ClassLabel's). Only the numbers are kept per image."""

from __future__ import annotations

import numpy as np

from imgtrain.data.limits import check_class_count
from imgtrain.errors import ImgtrainError


class ClassBook:
    def __init__(self, names: list[str] | None = None, mix_hint: str = "class indices and class names"):
        self.fixed = names  # the source's own class names: indices must be below their count
        self.mix_hint = mix_hint  # what a mix of the two kinds looks like in this source
        self.kind: str | None = None
        self.names: dict[str, int] = {}
        self.top = -1

    def indices(self, values: np.ndarray, where: str) -> np.ndarray:
        """Class indices (int64, none negative) as they are; an index beyond the source's class
        names is a ValueError (a bad sample), beyond MAX_CLASSES an error."""
        self._check_kind("index", where)
        if len(values) and self.fixed is not None and values.max() >= len(self.fixed):
            raise ValueError(f"label {values.max()} is not one of the {len(self.fixed)} class names")
        if len(values):
            self.top = max(self.top, int(values.max()))
            check_class_count(self.top + 1, f"class index {self.top} (at {where})", "use class indices 0..K-1")
        return values

    def name(self, name: str, where: str) -> int:
        """A class name's provisional number."""
        self._check_kind("name", where)
        if name not in self.names:
            check_class_count(len(self.names) + 1, "the class names", "check the labels")
            self.names[name] = len(self.names)
        return self.names[name]

    def _check_kind(self, kind: str, where: str) -> None:
        if self.kind is None:
            self.kind = kind
        elif self.kind != kind:
            raise ImgtrainError(f"the source mixes {self.mix_hint}, e.g. at {where}; label every sample the same way")

    def classes(self, provisional: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """(labels int64, class names): names sorted, indices as given (named by the source's
        class names when it has them, else "0", "1", ...)."""
        if self.kind != "name":
            return provisional, list(self.fixed) if self.fixed is not None else [str(i) for i in range(self.top + 1)]
        names = sorted(self.names)
        rank = np.empty(len(names), np.int64)
        rank[[self.names[n] for n in names]] = np.arange(len(names))
        return rank[provisional], names
