"""The exit codes of every ``fp8rl`` command (one table; README documents it).

===  ===================  ===================================================================================
 0   ``EXIT_OK``          conformant; every mutant killed; a gate passed; no regression
 1   ``EXIT_FAIL``        non-conformant (a check failed or errored, however the run ended); a mutant survived;
                          a gate failed; ``report diff`` found a regression
 2   ``EXIT_USAGE``       bad arguments, an unreadable or malformed input (xfails file), an output directory that
                          can't be written, or an engine that could not be loaded (its factory, ``version()``,
                          ``capabilities()`` or declared numerics raised)
 3   ``EXIT_SUSPECT``     ``perf gate``: the measurement itself is not trustworthy (too noisy, too few pairs)
 4   ``EXIT_INCOMPLETE``  nothing failed, but the verdict can't certify the engine: the run did not finish
                          (interrupted by SIGINT/SIGTERM, or the runner died; the checks that did not run are listed),
                          or it did not test the engine's own code — a capability the engine declares available ran
                          none of its cases on the engine's own code (every case refused with Unsupported, inherited
                          unchanged from fp8rl's oracle, or skipped), or no check ran engine code at all (the report's
                          ``summary.scope`` names each such capability); ``fp8rl parity``: underpowered, δ below
                          the gap its seeds detect at 80 % power (no parity verdict; docs/learning-parity.md)
===  ===================  ===================================================================================
"""

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_SUSPECT = 3
EXIT_INCOMPLETE = 4

#: report verdict → exit code
VERDICT_EXIT = {"conformant": EXIT_OK, "non-conformant": EXIT_FAIL, "incomplete": EXIT_INCOMPLETE}

__all__ = ["EXIT_FAIL", "EXIT_INCOMPLETE", "EXIT_OK", "EXIT_SUSPECT", "EXIT_USAGE", "VERDICT_EXIT"]
