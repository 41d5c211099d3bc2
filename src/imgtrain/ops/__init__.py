"""The lowest utilities (files, process, remote, spreadsheet): every layer uses them, so they
import nothing of imgtrain but ``errors`` (tests/test_layers.py holds them to it)."""
