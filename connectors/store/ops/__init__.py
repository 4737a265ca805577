"""Operations over any store, through the :class:`~..base.Store` interface only: walks,
filters and summaries (``scanning.py``), what ``purge`` removes (``plan.py``), checking
every entry (``verify.py``), and copies and page-cache warming (``transfer.py``)."""
