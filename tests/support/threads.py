"""Running one computation on several kernel thread counts."""


def at_thread_counts(run, counts=(1, 2)):
    """[run() with dynar's kernels on n threads for n in counts]; the thread count is
    restored afterwards."""
    from dynar.kernels import threads
    before = threads.get_num_threads()
    try:
        results = []
        for n in counts:
            threads.set_num_threads(n)
            results.append(run())
        return results
    finally:
        threads.set_num_threads(before)
