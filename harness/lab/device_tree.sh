#!/usr/bin/env bash
# The working tree that travels to the GPU machine is capped at 64 MiB; the tracked files are larger (the shipped
# weights and the committed results). During a device session, move those two folders out of the tree and carry
# what the device needs (wheels, the GGUF in parts, weights) in ignored folders named in `carry`:
#
#   bash harness/lab/device_tree.sh size          # tracked bytes in the tree: all, without weights/ and results/
#   bash harness/lab/device_tree.sh stash DIR     # move weights/ and results/ to DIR (before the device calls)
#   bash harness/lab/device_tree.sh restore DIR   # move them back (after the last call)
#   bash harness/lab/device_tree.sh mark          # (stash does it) .xb_commit anew: again after every commit or
#                                                 # edit made while stashed, before the next device call
#
# .xb_commit holds the commit and when it was marked ("+dirty" when a file that travels, tracked or untracked and
# not ignored, differed from it): the device runs a copy of the tree without .git, so the scripts copy this file
# beside the code and results_io.environment records it as the run's git_sha; restore removes it.
set -euo pipefail
cd "$(dirname "$0")/../.."
# the tracked files present in the tree (PATHSPEC...), in one du (its --files0-from): xargs split the list into batches,
# each with its own total, and the last batch's total was reported (99 MiB of 160 on 2026-12-07). While stashed,
# weights/ and results/ are missing: du skips them and exits 1, which is no failure here (set -e and pipefail
# ended `size` without a word)
tracked() { { git ls-files -z "$@" | du -cb --files0-from=- 2>/dev/null || true; } | tail -1 | cut -f1; }
mark() {  # the tree that travels against HEAD: weights/ and results/ (stashed) and the file itself left out
  local sha; sha=$(git rev-parse HEAD)
  [[ -z $(git status --porcelain -- . ':(exclude)weights' ':(exclude)results' ':(exclude).xb_commit') ]] ||
    sha="$sha+dirty"
  echo "$sha $(date -u +%Y-%m-%dT%H:%M:%SZ)" > .xb_commit
}
case "${1:-}" in
  size)
    all=$(tracked); rest=$(tracked -- . ':(exclude)weights' ':(exclude)results')
    echo "tracked: $(( all / 1048576 )) MiB; without weights/ and results/: $(( rest / 1048576 )) MiB (cap 64 MiB)"
    ;;
  stash)
    d=${2:?stash DIR}; mkdir -p "$d"
    [[ -e $d/weights || -e $d/results ]] && { echo "error: $d already holds weights/ or results/" >&2; exit 2; }
    mv weights results "$d"/
    mark
    ;;
  mark)
    mark; cat .xb_commit
    ;;
  restore)
    d=${2:?restore DIR}
    [[ -e weights || -e results ]] && { echo "error: weights/ or results/ is already in the tree" >&2; exit 2; }
    mv "$d"/weights "$d"/results .
    rm -f .xb_commit
    ;;
  *)
    sed -n 2,9p "$0"; exit 2
    ;;
esac
