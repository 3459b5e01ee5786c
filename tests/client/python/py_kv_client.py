"""A Python client process for the tests, the twin of tests/integration/integration_client.cc
(same arguments, same output, same prompt and KV pattern, so either side can read what the
other wrote):

  py_kv_client.py write <runtime_dir> <tokens> <seed>  allocate, write KV, commit; "written <sum>"
  py_kv_client.py read <runtime_dir> <tokens> <seed>   allocate, read the matched KV;
                                                      "matched <n> checksum <sum>"
  py_kv_client.py hold <runtime_dir> <sequences> <tokens>  allocate, print "holding", wait
"""

import signal
import sys

import kvpool

MASK = (1 << 64) - 1


def prompt(n: int, seed: int):
    tokens, x = [], (seed * 2654435761 + 1) & MASK
    for _ in range(n):
        x ^= (x << 13) & MASK
        x ^= x >> 7
        x ^= (x << 17) & MASK
        tokens.append(x % 32000)
    return tokens


def rows(client, table, tokens):
    """(position, layer, kind, view of that token's row) in integration_client's order."""
    layout, mapping = client.layout, client.mapping
    for p in range(tokens):
        block = table[p // layout.block_size]
        for layer in range(layout.num_layers):
            for kind in (0, 1):
                chunk = mapping.k(layer, block) if kind == 0 else mapping.v(layer, block)
                raw = chunk.cast("B")
                row = layout.row_bytes(layer, kind)
                start = (p % layout.block_size) * row
                yield p, layer, kind, raw[start : start + row]


def fnv(checksum: int, data) -> int:
    for byte in bytes(data):
        checksum = ((checksum ^ byte) * 1099511628211) & MASK
    return checksum


def main() -> int:
    mode, directory, a, b = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    client = kvpool.Client.connect(directory, client_name=f"py-{mode}", kv_access=True)
    if mode == "hold":
        for i in range(a):
            client.allocate_one(prompt(b, 1000 + i))
        print("holding", flush=True)
        while True:
            signal.pause()
    tokens = prompt(a, b)
    seq = client.allocate_one(tokens)
    checksum = 1469598103934665603
    if mode == "write":
        h, kv = b, []
        for t in tokens:
            h = (h * 31 + t) & MASK
            kv.append(h)
        for p, layer, kind, row in rows(client, seq.blocks, a):
            data = bytes((kv[p] >> ((i + layer + kind) % 56)) & 0xFF for i in range(len(row)))
            row[:] = data
            checksum = fnv(checksum, data)
        client.commit(seq.id, a)
        print(f"written {checksum}")
    elif mode == "read":
        for _, _, _, row in rows(client, seq.blocks, seq.matched_tokens):
            checksum = fnv(checksum, row)
        print(f"matched {seq.matched_tokens} checksum {checksum}")
    else:
        print(f"unknown mode {mode}", file=sys.stderr)
        return 2
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
