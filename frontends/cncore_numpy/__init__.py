"""cncore_numpy: the NumPy front end of cncore: the durable table file format.

(The `cn-table` command line and offline tools are the rest of its issue.)
"""
from cncore_numpy.format import (FORMAT_VERSION, TableFile, TableFormatError, load_table, open_table,
                                 save_table)

__all__ = ["save_table", "open_table", "load_table", "TableFile", "TableFormatError", "FORMAT_VERSION"]
