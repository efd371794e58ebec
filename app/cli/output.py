"""How `loraplex` prints what the API returns for people: timestamps, tables and records (the `--json`
output is the API's own JSON, printed by app.cli.common.emit)."""

from datetime import datetime

from rich import box
from rich.table import Table
from rich.text import Text

# Columns that stay whole (IDs, numbers, dates, statuses); any other column (names, tenant IDs as owners)
# folds onto more lines when the terminal is narrow.
WHOLE_COLUMNS = frozenset(
    {"ID", "PREFIX", "STATUS", "CREATED", "EXPIRES", "VER", "VERSION", "RANK", "SIZE", "SHA256"}
)


def fmt_time(value: object, *, date_only: bool = False) -> str:
    """An API timestamp as `YYYY-MM-DD HH:MM:SSZ` (UTC), or just the date; `-` for none."""
    if not isinstance(value, str) or not value:
        return "-"
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return value
    return parsed.strftime("%Y-%m-%d" if date_only else "%Y-%m-%d %H:%M:%SZ")


def table(*columns: str, min_width: int) -> Table:
    """A borderless listing with these column headers; a folding column is never narrower than
    `min_width`."""
    listing = Table(box=None, header_style="bold", pad_edge=False)
    for column in columns:
        whole = column in WHOLE_COLUMNS
        listing.add_column(column, no_wrap=whole, overflow="fold", min_width=None if whole else min_width)
    return listing


def record(title: str, rows: list[tuple[str, object]], *, pad_edge: bool = True) -> Table:
    """One object as a titled two-column table: field names in bold, then their values."""
    fields = Table(title=title, title_justify="left", show_header=False, box=box.SIMPLE, pad_edge=pad_edge)
    fields.add_column(style="bold")
    fields.add_column(overflow="fold")
    for field, value in rows:
        fields.add_row(field, *cells(value))
    return fields


def cells(*values: object) -> list[Text]:
    """Table cells as plain text (`-` for none or empty): names from the API are never read as Rich
    markup."""
    return [Text("-" if value is None or value == "" else str(value)) for value in values]
