"""folder: PNG/JPEG images in one subfolder per class (or train/ and test/ folders of them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from imgtrain.data.limits import check_class_count
from imgtrain.data.listing import Listing, files_listing
from imgtrain.errors import ImgtrainError

_JUNK_FILES = {"thumbs.db", "desktop.ini"}


def list_image_folder(root, seed: int = 0) -> Listing:
    """Class-per-subfolder PNG/JPEG images; class names are the sorted subfolder names. With
    ``root/train/`` and ``root/test/`` (each holding class subfolders) those are the splits."""
    root = Path(root)
    if not root.is_dir():
        raise ImgtrainError(f"image folder {root} does not exist; pass a folder with one subfolder per class")
    presplit = (root / "train").is_dir() and (root / "test").is_dir()
    tops = [root / "train", root / "test"] if presplit else [root]
    classes = [d.name for d in _class_dirs(tops[0])]
    if presplit:
        extra = sorted({d.name for d in _class_dirs(root / "test")} - set(classes))
        if extra:
            raise ImgtrainError(f"{root / 'test'} has class folders missing from {root / 'train'}: "
                                f"{', '.join(extra)}; every test class needs training images")
    check_class_count(len(classes), f"the class folders of {tops[0]}")
    if len(classes) < 2:
        raise ImgtrainError(f"{tops[0]} has {len(classes)} class folder(s); a classifier needs at least 2 "
                            "subfolders (one per class) holding PNG/JPEG images")
    entries = []  # (relative path, class index, is_test)
    for top in tops:
        for c, name in enumerate(classes):
            files = _image_files(top / name) if (top / name).is_dir() else []
            if not files and top == tops[0]:
                raise ImgtrainError(f"class folder {top / name} has no images; add some or remove it")
            entries += [(p.relative_to(root).as_posix(), c, top.name == "test" and presplit) for p in files]
    entries.sort()
    if presplit and not any(is_test for *_, is_test in entries):
        raise ImgtrainError(f"{root / 'test'} has no images; add some or remove the folder")
    labels = np.array([c for _, c, _ in entries], np.int64)
    test = np.array([t for *_, t in entries], bool) if presplit else None
    return files_listing(classes, [rel for rel, _, _ in entries], labels, test, root, seed)


def _class_dirs(root: Path) -> list[Path]:
    return sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))


def _image_files(class_dir: Path) -> list[Path]:
    """Every non-hidden file under ``class_dir`` (non-images are reported, not skipped), FIFOs and
    other special files too: they are reported unread (``images.read_image_file``). rglob does not
    follow linked folders: a link to a parent cannot make it walk in circles."""
    return [p for p in class_dir.rglob("*")
            if not p.is_dir() and not any(part.startswith(".") for part in p.relative_to(class_dir).parts)
            and p.name.lower() not in _JUNK_FILES]
