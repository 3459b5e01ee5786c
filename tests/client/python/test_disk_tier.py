"""The disk tier against real processes (docs/tiers.md): a prefix computed before a restart
(SIGTERM, or kill -9 in the middle of a burst of writes) is found on disk after it and gives the
same greedy token; nothing torn is ever served; a budget smaller than the workload and a file
system that fills up cost no call, only counted errors; `kvpoolctl invalidate` makes every tier
forget one tenant and only it, across a restart too. The blocks found on disk at start are
in the event stream's snapshot."""

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import unittest

import kvpool
from kvpool_testing import Daemon, KVPOOLCTL, SMALL_CONFIG, run, wait_until

PROMPT_TOKENS = 80  # five full blocks


def prompt(seed, n=PROMPT_TOKENS):
    return [(seed * 7919 + 13 * i) % 500 + 1 for i in range(n)]


def until(predicate, what, timeout=20):
    if not wait_until(predicate, timeout=timeout):
        raise AssertionError(f"timed out waiting for {what}")


def disk(stats):
    for s in stats.tiers.stores:
        if s.medium == "disk":
            return s
    raise AssertionError(f"no disk tier in {stats.tiers}")


def snapshot_disk_blocks(client):
    """The disk tier's blocks (hi, lo) in the daemon's WatchEvents snapshot."""
    blocks = set()
    for response in client.watch_events(snapshot=True):
        if not response.snapshot:
            break
        for e in response.events:
            if e.medium == "disk":
                blocks.update((h.hi, h.lo) for h in e.block_hashes)
    return blocks


class DiskTierCase(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvpool-disk-py-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.secret = os.path.join(self.dir, "secret")
        fd = os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32))
        os.close(fd)
        self.tier_dir = os.path.join(self.dir, "tier")

    def config(self, capacity_bytes=64 << 20, directory=None):
        return (SMALL_CONFIG + f'\nsecret_file: "{self.secret}"\n'
                f'tiers {{ disk {{ directory: "{directory or self.tier_dir}" '
                f"capacity_bytes: {capacity_bytes} }} }}\n")

    def fill(self, daemon, seeds, tenant="default"):
        """Prefills and commits each seed's prompt; returns {seed: greedy token}."""
        tokens = {}
        with kvpool.Client.connect(daemon.dir, tenant=tenant, client_name="fill") as c:
            for seed in seeds:
                first = c.prefill(prompt(seed))
                tokens[seed] = first.next_token
                c.free([first.sequence_id], commit=True)
        return tokens


class WarmRestartTest(DiskTierCase):
    def test_the_first_prefill_after_a_restart_reuses_the_prefix_with_the_same_token(self):
        with Daemon(self.config()) as a:
            before = self.fill(a, [1, 2])
            with kvpool.Client.connect(a.dir, client_name="watch") as c:
                until(lambda: disk(c.get_stats()).written >= 10, "ten blocks on disk")
        # A fresh daemon (fresh pool, fresh runtime directory) on the same tier directory.
        with Daemon(self.config()) as b:
            with kvpool.Client.connect(b.dir, client_name="after") as c:
                self.assertEqual(disk(c.get_stats()).recovered_blocks, 10)
                # They are the disk tier's in the events too (docs/events.md, Snapshots).
                self.assertEqual(len(snapshot_disk_blocks(c)), 10)
                rc, out = run([KVPOOLCTL(), f"--socket_dir={b.dir}", "--snapshot", "events"])
                self.assertEqual(rc, 0, out)
                self.assertIn(", 10 disk;", out.splitlines()[0])
                again = c.prefill(prompt(1))
                self.assertEqual(again.reused_tokens, PROMPT_TOKENS - 1)  # the last one computed
                self.assertEqual(again.next_token, before[1])
                stats = c.get_stats()
                self.assertEqual(stats.tiers.promoted_from_disk, 5)
                self.assertEqual(disk(stats).hits, 5)
                self.assertTrue(c.check_invariants().ok)

    def test_after_kill_9_in_a_burst_of_writes_every_block_served_is_whole(self):
        seeds = list(range(10, 34))
        with Daemon(SMALL_CONFIG) as control:  # no tiers: the tokens a cold prefill gives
            expected = self.fill(control, seeds)
        a = Daemon(self.config())
        try:
            # The burst goes on past the prompts checked, so the kill lands in the middle of it.
            burst = threading.Thread(target=self.burst, args=(a, range(10, 400)), daemon=True)
            burst.start()
            with kvpool.Client.connect(a.dir, client_name="watch") as c:
                until(lambda: disk(c.get_stats()).written >= 30, "thirty blocks on disk")
            a.process.send_signal(signal.SIGKILL)  # in the middle of the burst
            a.process.wait()
            burst.join(timeout=30)
        finally:
            a.close()
        self.flip_a_byte_of_a_stored_record()
        with Daemon(self.config()) as b:
            with kvpool.Client.connect(b.dir, client_name="after") as c:
                recovered = disk(c.get_stats()).recovered_blocks
                self.assertGreater(recovered, 0)
                for seed in seeds:
                    got = c.prefill(prompt(seed))
                    # Whole blocks from disk (or none), then the rest computed: never a torn one.
                    self.assertIn(got.reused_tokens, [0, 16, 32, 48, 64, PROMPT_TOKENS - 1])
                    self.assertEqual(got.next_token, expected[seed], f"prompt {seed}")
                    c.free([got.sequence_id])
                stats = c.get_stats()
                self.assertGreater(stats.tiers.promoted_from_disk, 0)
                # The flipped record (and any torn by the kill): a miss, dropped, never data.
                self.assertGreaterEqual(disk(stats).forged, 1)
                self.assertTrue(c.check_invariants().ok)

    @staticmethod
    def burst(daemon, seeds):
        try:
            with kvpool.Client.connect(daemon.dir, client_name="burst") as c:
                for seed in seeds:
                    first = c.prefill(prompt(seed))
                    c.free([first.sequence_id], commit=True)
        except Exception:  # the daemon was killed under it
            pass

    def flip_a_byte_of_a_stored_record(self):
        index = open(os.path.join(self.tier_dir, "default", "index.kvi"), "rb").read()
        slot = next(i for i in range(len(index) // 128) if index[i * 128:i * 128 + 4] == b"KVPI")
        data = os.path.join(self.tier_dir, "default", "blocks.kvd")
        with open(data, "r+b") as f:
            slot_bytes = os.path.getsize(data) // (len(index) // 128)
            f.seek(slot * slot_bytes + 1000)
            byte = f.read(1)
            f.seek(slot * slot_bytes + 1000)
            f.write(bytes([byte[0] ^ 0xFF]))


class FullDiskTest(DiskTierCase):
    def test_a_budget_smaller_than_the_workload_evicts_and_serving_goes_on(self):
        with Daemon(self.config(capacity_bytes=8 * 65536)) as a:
            tokens = self.fill(a, range(40, 46))  # 30 blocks into 8 slots
            with kvpool.Client.connect(a.dir, client_name="watch") as c:
                until(lambda: disk(c.get_stats()).written >= 30, "every block on disk")
                stats = disk(c.get_stats())
                self.assertEqual(stats.blocks, 8)
                self.assertEqual(stats.evicted, stats.written - 8)
                self.assertEqual(c.prefill(prompt(45)).next_token, tokens[45])

    @unittest.skipUnless(os.geteuid() == 0, "mounting a tmpfs needs root")
    def test_a_file_system_that_fills_up_costs_no_call_and_is_counted(self):
        mnt = os.path.join(self.dir, "mnt")
        os.mkdir(mnt)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "kvpool-test", mnt],
                          capture_output=True).returncode != 0:
            self.skipTest("cannot mount a tmpfs here")
        self.addCleanup(subprocess.run, ["umount", "-l", mnt], capture_output=True)
        # 256 KiB of file system under a 4 MiB budget: the fifth block on finds no space.
        with Daemon(self.config(capacity_bytes=4 << 20, directory=mnt)) as a:
            tokens = self.fill(a, range(50, 54))
            with kvpool.Client.connect(a.dir, client_name="watch") as c:
                until(lambda: disk(c.get_stats()).write_errors >= 1, "a failed write counted")
                for seed in range(50, 54):
                    self.assertEqual(c.prefill(prompt(seed)).next_token, tokens[seed])
                self.assertEqual(c.get_stats().failure, "")  # still serving
                self.assertTrue(c.check_invariants().ok)


class InvalidateTest(DiskTierCase):
    def test_invalidate_forgets_one_tenant_in_every_tier_and_across_a_restart(self):
        config = self.config().replace("tiers {", "tiers { host_blocks: 64")
        with Daemon(config) as a:
            self.fill(a, [60], tenant="a")
            kept = self.fill(a, [60], tenant="b")  # the same prompt, another tenant
            with kvpool.Client.connect(a.dir, tenant="a", client_name="a") as ca:
                until(lambda: disk(ca.get_stats()).written >= 10, "both tenants on disk")
                self.assertEqual(ca.match_prefix(prompt(60)), PROMPT_TOKENS)
                rc, out = run([KVPOOLCTL(), f"--socket_dir={a.dir}", "invalidate", "--tenant=a"])
                self.assertEqual(rc, 0, out)
                self.assertIn("invalidated tenant a", out)
                stats = ca.get_stats()
                self.assertEqual(stats.invalidations, 1)
                self.assertEqual(disk(stats).invalidated, 5)
                # Not from the device pool, the host tier or the disk: for a session that was
                # there before, and for a new one (an Allocate promotes whatever a tier has, and
                # publishes nothing itself).
                self.assertEqual(ca.match_prefix(prompt(60)), 0)
            with kvpool.Client.connect(a.dir, tenant="a", client_name="a2", kv_access=True) as a2:
                self.assertEqual(a2.allocate_one(prompt(60)).matched_tokens, 0)
            with kvpool.Client.connect(a.dir, tenant="b", client_name="b") as cb:
                again = cb.prefill(prompt(60))
                self.assertEqual(again.reused_tokens, PROMPT_TOKENS - 1)
                self.assertEqual(again.next_token, kept[60])
        with Daemon(config) as b:
            with kvpool.Client.connect(b.dir, tenant="a", client_name="a") as ca:
                self.assertEqual(ca.prefill(prompt(60)).reused_tokens, 0)
            with kvpool.Client.connect(b.dir, tenant="b", client_name="b") as cb:
                self.assertEqual(cb.prefill(prompt(60)).reused_tokens, PROMPT_TOKENS - 1)
                self.assertGreater(cb.get_stats().tiers.promoted_from_disk, 0)


if __name__ == "__main__":
    unittest.main()
