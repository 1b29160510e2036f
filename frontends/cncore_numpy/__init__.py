"""cncore_numpy: the NumPy front end of cncore.

- `Table`: a dynamic embedding table with NumPy arrays in and out (`table.py`);
- the durable table file format, re-exported from the core where it lives (`cncore.tablefile`,
  shared by every front end): `save_table`, `open_table` (memory-mapped, checked, offline
  lookups and pooled scoring), `TableWriter`; `load_table` gives a `Table`;
- `cn-table`, offline tools over table files (`cli.py`, `tools.py`, `exchange.py`).
"""
from cncore.tablefile import FORMAT_VERSION, TableFile, TableFormatError, TableWriter, open_table, save_table
from cncore_numpy.table import Table, load_table

__all__ = ["Table", "save_table", "open_table", "load_table", "TableFile", "TableWriter", "TableFormatError",
           "FORMAT_VERSION"]
