"""The data sources of ``data prepare``: one module per source, each registering its spec
(``registry.py``). Importing this package registers them all, in the order listed here: the order
``data prepare --help`` and its messages name them. A new source is a new module, named here."""

from imgtrain.data.sources import mnist_sample, mnist, folder, parquet, path_list, webdataset, hf

__all__ = ["mnist_sample", "mnist", "folder", "parquet", "path_list", "webdataset", "hf"]  # imported for their registration
