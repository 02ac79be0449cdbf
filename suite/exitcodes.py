"""The exit codes of every ``fp8rl`` command (one table; README documents it).

===  ==================  ===================================================================================
 0   ``EXIT_OK``         conformant; every mutant killed; a gate passed; no regression
 1   ``EXIT_FAIL``       non-conformant (a check failed or errored); a mutant survived; a gate failed;
                         ``report diff`` found a regression
 2   ``EXIT_USAGE``      bad arguments, an unreadable input, or an engine that could not be loaded
 3   ``EXIT_SUSPECT``    ``perf gate``: the measurement itself is not trustworthy (too noisy, too few pairs)
===  ==================  ===================================================================================
"""

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_SUSPECT = 3

__all__ = ["EXIT_FAIL", "EXIT_OK", "EXIT_SUSPECT", "EXIT_USAGE"]
