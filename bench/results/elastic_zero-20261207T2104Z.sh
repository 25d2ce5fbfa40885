#!/bin/bash
cd /work/main/build
for round in 1 2 3; do
  for zero in 0 1 3; do
    for every in 1 0; do
      line=$(./bin/shoal run --min 2 --max 2 -n 2 ./bench/elastic --steps 80 --commit-every $every --zero $zero 2>/dev/null | grep "elastic steps" | tail -1)
      echo "round=$round zero=$zero $line"
    done
  done
done
