"""cncore_numpy: the NumPy front end of cncore.

- `Table`: a dynamic embedding table with NumPy arrays in and out (`table.py`);
- the durable table file format: `save_table`, `open_table` (memory-mapped, checked, offline
  lookups and pooled scoring), `load_table`, `TableWriter` (`format.py`);
- `cn-table`, offline tools over table files (`cli.py`, `tools.py`, `exchange.py`).
"""
from cncore_numpy.format import (FORMAT_VERSION, TableFile, TableFormatError, TableWriter, open_table,
                                 save_table)
from cncore_numpy.table import Table, load_table

__all__ = ["Table", "save_table", "open_table", "load_table", "TableFile", "TableWriter", "TableFormatError",
           "FORMAT_VERSION"]
