"""The layering check catches what it claims to: a scratch tree with one include per rule broken,
beside the real tree, which must pass."""

import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "check_includes.py")
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def run(root):
    return subprocess.run([sys.executable, CHECK, "--root", root], capture_output=True, text=True)


class CheckIncludesTest(unittest.TestCase):
    def test_the_tree_follows_the_rules(self):
        done = run(ROOT)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)

    def test_each_broken_rule_is_reported(self):
        broken = {
            "daemon/engine/a.cc": ['#include "grpcpp/grpcpp.h"', '#include "kvpool/v1/kvpool.pb.h"',
                                   '#include "google/protobuf/message.h"'],
            "kvpool/b.cc": ['#include "kernels/device.h"', '#include "grpcpp/grpcpp.h"'],
            "kvpool/util/c.h": ['#include "kvpool/block_pool.h"'],
            "client/d.cc": ['#include "daemon/engine/engine.h"', '#include "kvpool/block_pool.h"'],
            "tier/e.cc": ['#include "daemon/engine/tiers.h"'],
        }
        fine = {
            "daemon/engine/ok.cc": ['#include "kvpool/kv_cache_manager.h"', "#include <vector>"],
            "client/ok.cc": ['#include "kvpool/util/check.h"', '#include "kvpool/v1/wire.h"'],
        }
        with tempfile.TemporaryDirectory() as root:
            for path, lines in {**broken, **fine}.items():
                os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
                with open(os.path.join(root, path), "w") as f:
                    f.write("\n".join(lines) + "\n")
            done = run(root)
        self.assertEqual(done.returncode, 1)
        reported = [line for line in done.stdout.splitlines() if not line.startswith("layering:")]
        self.assertEqual(len(reported), sum(len(v) for v in broken.values()), done.stdout)
        for path in fine:
            self.assertNotIn(path, done.stdout)


if __name__ == "__main__":
    unittest.main()
