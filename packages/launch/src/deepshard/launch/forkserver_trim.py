"""Imported last by ``launch_local``'s forkserver, after its preloads: what the workers fork from is
settled, so keep it shared.

``gc.freeze()`` moves every object the imports made to the permanent generation.  Without it a
worker's first full collection writes the gc header of each of those objects, and so copies on write
the server's pages into every worker (measured here: +80 MB of private memory per worker at its
first ``gc.collect()``, with torch and the app imported; 0-1 MB frozen).  The server's own heap is
not trimmed: ``malloc_trim`` there returned nothing measurable (imports free little).
"""

import gc

gc.collect()  # what the imports dropped goes now, not into the permanent generation
gc.freeze()
