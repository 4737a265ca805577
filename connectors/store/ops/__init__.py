"""Operations over any store, through the :class:`~..base.Store` interface only: walks,
filters and summaries (``scanning.py``), what ``purge`` removes (``plan.py``), checking
every entry (``verify.py``), copies and page-cache warming (``transfer.py``), and the data
of ``list``, ``stats`` and ``size`` (``report.py``)."""
