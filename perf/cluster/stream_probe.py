"""The program behind bandwidth.measure: one TCP stream, `receive` in one emulated host and
`send` in another.

    python -m perf.cluster.stream_probe receive PORT
    python -m perf.cluster.stream_probe send ADDR PORT SECONDS

The receiver measures, because only bytes that arrived crossed both shaped links: it
prints "listening" once it accepts connections, then one JSON line
{"bytes": ..., "seconds": ..., "gbit_per_s": ...} timed from the end of the first read to
the end of the stream (the first read is not counted, so connection set-up and the token
bucket's initial burst don't enter the rate).
"""
import json
import socket
import sys
import time

CHUNK = 1 << 20


def receive(port, ready_timeout=30.0):
    with socket.create_server(("0.0.0.0", port)) as server:
        server.settimeout(ready_timeout)
        # The parent waits for this line before starting the sender.
        print("listening", flush=True)
        conn, _ = server.accept()
    with conn:
        buf = bytearray(CHUNK)
        first = conn.recv_into(buf)
        start = time.perf_counter()
        total = 0
        while True:
            n = conn.recv_into(buf)
            if n == 0:
                break
            total += n
        seconds = time.perf_counter() - start
    result = {"bytes": total, "seconds": seconds,
              "gbit_per_s": total * 8 / seconds / 1e9 if seconds > 0 else 0.0,
              "first_chunk": first}
    print(json.dumps(result), flush=True)
    return result


def send(addr, port, seconds):
    payload = bytes(CHUNK)
    with socket.create_connection((addr, port), timeout=30) as conn:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        # Wait for the receiver to close, so that "sent" means "arrived".
        conn.recv(1)


def main(argv):
    if argv[:1] == ["receive"] and len(argv) == 2:
        receive(int(argv[1]))
    elif argv[:1] == ["send"] and len(argv) == 4:
        send(argv[1], int(argv[2]), float(argv[3]))
    else:
        sys.exit("usage: python -m perf.cluster.stream_probe receive PORT | send ADDR PORT SECONDS")


if __name__ == "__main__":
    main(sys.argv[1:])
