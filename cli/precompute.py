"""`encache precompute` (being written)."""
import typer


def register(app: typer.Typer) -> None:
    pass
