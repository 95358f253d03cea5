#!/bin/bash
# Each probe in a fresh process; prints one [name] PASS/FAIL line each.
cd "$(dirname "$0")"
t() { /usr/bin/time -f "   process wall %es" timeout 300 python "$@" 2>&1 | grep "^\[\|process wall\|^  [a-zG]"; }
t p1.py
t p2.py 2>/dev/null | head -1
for p in p2b p2c p2d p2e p2f; do t p2x.py $p; done
for p in p3a p3b p3c p3d p3e; do t p3.py $p; done
for p in p4a p4b p4c; do t p4.py $p; done
for p in p5a p5b p5c; do t p5.py $p; done
for p in p6a p6c p6d p6e; do t p6.py $p; done
for v in lax_iota plgpu_iota_nolayout layout_cast; do t p7.py $v; done
