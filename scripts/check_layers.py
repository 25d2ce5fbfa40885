#!/usr/bin/python3
"""Checks the layer order of docs/design.md against the sources (ctest LayerOrder).

Reads the order table of docs/design.md (one row per layer: its number and its parts) and fails,
naming each offending line, when
  - a header or source of one part includes a header of a part in a later layer, or of another
    part of its own layer (parts on one row do not include each other);
  - a header or source of one part includes a header of another part that the table's "reached
    through" column does not name for that part (each part is reached through the headers it
    names there, its other headers are its own);
  - a folder under src/ or include/shoal/ is not a part of the table;
  - a source file outside tests/ has more than 700 lines, unless it is listed below with the count
    it may not exceed (files still to be split; docs/design.md, "Where the code may still differ").

Usage: check_layers.py [REPOSITORY]   (default: this script's repository)
"""
import fnmatch
import os
import re
import sys

MAX_LINES = 700
# Files still over MAX_LINES, with the count each may not exceed until it is split.
STILL_LONG = {
}

# Includes of another part's header that the order table does not name, still to be mended
# (docs/design.md, "Where the code may still differ"): (the including file, the included header).
STILL_REACHING = {
}

# Files of no part: the umbrella header, the precompiled header.
NO_PART = {'include/shoal/shoal.h', 'src/pch.h', 'src/pch.cpp'}


def read_order(root):
    """({part: layer}, {part: [path patterns]}) from the table under "## The order" in
    docs/design.md. The third column names, in backticks, the headers through which other parts
    reach a part: `shoal/...` (under include/), `src/...`, a folder ending in '/', or a bare file
    name in the folder of the path before it."""
    order, reach = {}, {}
    in_section = False
    with open(os.path.join(root, 'docs', 'design.md'), encoding='utf-8') as f:
        for line in f:
            if line.startswith('## '):
                in_section = line.strip() == '## The order'
                continue
            m = re.match(r'\|\s*(\d+)\s*\|\s*([a-z, ]+?)\s*\|([^|]*)\|', line) if in_section else None
            if not m:
                continue
            patterns, folder = [], ''
            for token in re.findall(r'`([^`]+)`', m.group(3)):
                if token.startswith('shoal/'):
                    token = 'include/' + token
                elif not token.startswith('src/'):
                    if '/' in token or not token.endswith('.h'):
                        continue  # not a path: a type or a command
                    token = folder + token
                folder = token if token.endswith('/') else os.path.dirname(token) + '/'
                patterns.append(token + '*' if token.endswith('/') else token)
            for part in m.group(2).split(','):
                order[part.strip()] = int(m.group(1))
                reach[part.strip()] = patterns
    if not order:
        sys.exit('check_layers: no order table under "## The order" in docs/design.md')
    return order, reach


def part_of(path):
    """The part a repository path belongs to, or None for a file of no part."""
    if path in NO_PART:
        return None
    if path in ('src/init.cpp', 'include/shoal/init.h'):
        return 'init'
    m = re.match(r'(?:src|include/shoal)/([^/]+)/', path)
    return m.group(1) if m else ''


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), '..'))
    order, reach = read_order(root)
    problems = []
    still_reaching = set(STILL_REACHING)
    for top in ('src', 'include/shoal'):
        for directory, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith(('.h', '.cpp', '.cc')):
                    continue
                full = os.path.join(directory, name)
                path = os.path.relpath(full, root)
                me = part_of(path)
                if me is None:
                    continue
                if me not in order:
                    problems.append(f'{path}: its part "{me}" is not in docs/design.md\'s order')
                    continue
                with open(full, encoding='utf-8', errors='replace') as f:
                    lines = f.readlines()
                limit = STILL_LONG.get(path, MAX_LINES)
                if len(lines) > limit:
                    problems.append(f'{path}: {len(lines)} lines; expected at most {limit}')
                for number, line in enumerate(lines, 1):
                    m = re.match(r'\s*#\s*include\s*[<"]([^">]+)[">]', line)
                    if not m:
                        continue
                    included = m.group(1)
                    candidates = [os.path.join(directory, included),
                                  os.path.join(root, 'src', included),
                                  os.path.join(root, 'include', included)]
                    target = next((c for c in candidates if os.path.isfile(c)), None)
                    if target is None:
                        continue  # a system or third-party header
                    other = part_of(os.path.relpath(os.path.normpath(target), root))
                    if not other or other == me or other not in order:
                        continue
                    if order[other] >= order[me]:
                        relation = 'a later layer' if order[other] > order[me] else 'its own layer'
                        problems.append(f'{path}:{number}: {me} (layer {order[me]}) includes '
                                        f'{included} of {other}, {relation} ({order[other]})')
                        continue
                    target_path = os.path.relpath(os.path.normpath(target), root)
                    if (path, target_path) in STILL_REACHING:
                        still_reaching.discard((path, target_path))
                        continue
                    if not any(fnmatch.fnmatch(target_path, p) for p in reach[other]):
                        problems.append(f'{path}:{number}: {me} includes {target_path}, which '
                                        f'docs/design.md does not name among the headers {other} '
                                        'is reached through')
    for path, limit in STILL_LONG.items():
        full = os.path.join(root, path)
        if os.path.isfile(full):
            with open(full, encoding='utf-8', errors='replace') as f:
                count = sum(1 for _ in f)
            if count <= MAX_LINES:
                problems.append(f'{path}: {count} lines, within {MAX_LINES}; remove it from '
                                'STILL_LONG in scripts/check_layers.py')
        else:
            problems.append(f'{path}: listed in STILL_LONG but gone; remove it from the list')
    for path, header in sorted(still_reaching):
        problems.append(f'{path}: listed in STILL_REACHING with {header}, which it no longer '
                        'includes; remove it from the list')
    for problem in problems:
        print(problem)
    if problems:
        sys.exit(1)
    print(f'layer order holds over {len(order)} parts')


if __name__ == '__main__':
    main()
