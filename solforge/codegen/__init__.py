"""solforge's own code generator: any fusible memory-bound region of an ATen graph -> Triton.

  regions.py     maximal fusible groups of an ATen fx graph, between anchors
  ir.py          a region as plain data (numbered inputs, ATen ops, outputs); canonical text and key
  lower.py       ATen ops -> kernel graph (load/const/pw/view/reduce); the region's loop space
  schedule.py    Schedule and the triad space / is_valid / heuristic
  triton_gen.py  region + schedule -> the source of one @triton.jit kernel
  reference.py   the region's own ATen ops in fp64: the reference every generated kernel must match
  runtime.py     source file cache, import, output allocation, launch (`run`)
  store.py       a region back from its key (JSON next to the sources)
  backward.py    a region's vjp traced to ATen and formed into one region: its generated backward
"""
