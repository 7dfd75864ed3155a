#!/usr/bin/env python3
"""Serve N `moec serve` replicas on a Ray cluster behind one OpenAI-compatible address.

    python3 scripts/ray_serve.py --replicas 2 [--address auto] [--port 8000] \
        -- schedules/baselines/resident.sched --model ... --max-batch 8

Each replica is a Ray actor that starts `moec serve ARGS --host HOST --port 0` on its node
and reports the address it listens on; the actor is created with `max_restarts=-1`, so
when its process dies Ray starts it again, which starts a fresh `moec serve`. The moec
process is tied to its actor (it gets SIGTERM when the actor's process ends, and the actor
ends when moec does), so neither outlives the other.

A router in this process listens on --host:--port (port 0 picks a free one; the first line
on stdout is `listening on http://ADDR`, as `moec serve` prints) and forwards every request
to the next healthy replica in turn, streaming the answer back as it comes (server-sent
events included). A health checker calls every replica's `/health` each
--health-interval seconds; a replica that fails --unhealthy-after checks in a row, or
whose moec process is gone, leaves the rotation and its actor is killed so Ray restarts
it; it rejoins once its new `/health` answers. A request whose replica fails before any
byte of the answer reached the client (refused connection, a replica that died before
answering) is sent to the next replica, so a killed replica loses none of the requests
waiting for it; a stream already under way when its replica dies ends there (its text
cannot be resumed elsewhere). The router answers `/health` (200 while a replica is
healthy) and `/replicas` (each replica's address, moec process id, health and restarts)
itself.

Without --address, `ray.init()` starts a local cluster of --num-cpus CPUs; with
`--address auto` (after `ray start --head` on one node and `ray start --address HEAD:6379`
on the others) it joins that cluster and spreads the replicas over its nodes (each takes
--cpus-per-replica CPUs and --gpus-per-replica GPUs: 1 by default with `--backend cuda`).
Every node needs the moec binary at the same path (--moec) and the model's weights. The
replicas listen on their node's address (--replica-host, default: the node's IP on a
cluster, 127.0.0.1 locally), which the router must reach; put the router's port behind
your load balancer or firewall, as moec's own `--api-key` (passed through ARGS) still
guards every replica. SIGINT or SIGTERM stops the router and the replicas.
"""

import argparse
import http.client
import http.server
import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
}


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Run N `moec serve` replicas on Ray behind one router."
    )
    parser.add_argument("--replicas", type=int, default=2, help="number of replicas")
    parser.add_argument("--moec", default="moec", help="the moec binary")
    parser.add_argument("--address", help="Ray cluster address (default: a local cluster)")
    parser.add_argument("--num-cpus", type=int, help="CPUs of the local cluster")
    parser.add_argument("--cpus-per-replica", type=float, default=1.0)
    parser.add_argument(
        "--gpus-per-replica",
        type=float,
        help="GPUs a replica takes (default: 1 with --backend cuda, else 0)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the router's address")
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument(
        "--replica-host",
        help="address the replicas listen on (default: 127.0.0.1 locally, the node IP on a cluster)",
    )
    parser.add_argument("--health-interval", type=float, default=1.0)
    parser.add_argument("--unhealthy-after", type=int, default=2)
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per upstream read"
    )
    parser.add_argument(
        "moec_args",
        nargs=argparse.REMAINDER,
        help="-- then the arguments of `moec serve` (schedule first)",
    )
    args = parser.parse_args(argv)
    moec_args = args.moec_args
    if moec_args and moec_args[0] == "--":
        moec_args = moec_args[1:]
    if not moec_args:
        parser.error("give `moec serve`'s arguments after --, the schedule first")
    for flag in ("--port", "--host"):
        if flag in moec_args:
            parser.error(f"{flag} is the router's; each replica picks its own")
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    args.moec_args = moec_args
    if args.gpus_per_replica is None:
        cuda = any(
            a == "cuda" and i > 0 and moec_args[i - 1] == "--backend"
            for i, a in enumerate(moec_args)
        ) or "--backend=cuda" in moec_args
        args.gpus_per_replica = 1.0 if cuda else 0.0
    return args


def die_with_parent():
    """In the moec child: SIGTERM when the actor's process (its parent) ends (Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class Replica:
    """A Ray actor owning one `moec serve` process."""

    def __init__(self, moec, moec_args, host):
        import ray

        if host is None:
            host = ray.util.get_node_ip_address()
        self.proc = subprocess.Popen(
            [moec, "serve", *moec_args, "--host", host, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=sys.stderr,
            text=True,
            preexec_fn=die_with_parent,
        )
        line = self.proc.stdout.readline().strip()
        prefix = "listening on http://"
        if not line.startswith(prefix):
            self.proc.kill()
            raise RuntimeError(f"moec serve did not start: {line!r}")
        self.addr = line[len(prefix) :]
        # Without a reader its later stdout would fill the pipe and block it.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        # The actor ends when moec does, so Ray restarts both.
        threading.Thread(target=self._exit_with_moec, daemon=True).start()

    def _exit_with_moec(self):
        self.proc.wait()
        os._exit(1)

    def info(self):
        return {"addr": self.addr, "pid": self.proc.pid}


class Pool:
    """The replicas, their health, and the router's rotation."""

    def __init__(self, ray, actor_class, args):
        self.ray = ray
        self.args = args
        self.lock = threading.Lock()
        self.next = 0
        self.replicas = []
        for i in range(args.replicas):
            handle = actor_class.options(
                max_restarts=-1,
                max_task_retries=-1,
                num_cpus=args.cpus_per_replica,
                num_gpus=args.gpus_per_replica,
                name=f"moec-replica-{i}",
                lifetime=None,
            ).remote(args.moec, args.moec_args, args.replica_host)
            self.replicas.append(
                {
                    "index": i,
                    "handle": handle,
                    "addr": None,
                    "pid": None,
                    "healthy": False,
                    "failures": 0,
                    "restarts": 0,
                }
            )

    def refresh(self, r, timeout):
        """Asks the actor where its moec listens (after a start or a restart)."""
        try:
            info = self.ray.get(r["handle"].info.remote(), timeout=timeout)
        except Exception:  # still starting, or restarting
            return False
        with self.lock:
            if r["pid"] is not None and info["pid"] != r["pid"]:
                r["restarts"] += 1
            r["addr"], r["pid"] = info["addr"], info["pid"]
        return True

    def healthy_now(self, r):
        if r["addr"] is None:
            return False
        host, port = r["addr"].rsplit(":", 1)
        try:
            c = http.client.HTTPConnection(host, int(port), timeout=5)
            c.request("GET", "/health")
            ok = c.getresponse().status == 200
            c.close()
            return ok
        except OSError:
            return False

    def check(self):
        """One round of health checks. A replica whose actor does not answer is starting
        or being restarted by Ray (its moec died, which ends the actor): it stays out of
        the rotation until it answers. One whose actor answers but whose moec fails
        --unhealthy-after checks in a row (hung) has its actor killed, for Ray to restart."""
        for r in self.replicas:
            if r["addr"] is None or not r["healthy"]:
                if not self.refresh(r, timeout=0.5):
                    with self.lock:
                        r["healthy"], r["addr"] = False, None
                    continue
            if self.healthy_now(r):
                with self.lock:
                    r["healthy"], r["failures"] = True, 0
                continue
            with self.lock:
                r["failures"] += 1
                was = r["healthy"]
                r["healthy"] = False
                failures = r["failures"]
            if was:
                log(f"replica {r['index']} at {r['addr']} failed its health check")
            if failures >= self.args.unhealthy_after:
                log(f"replica {r['index']}: its moec does not answer; restarting it")
                try:
                    self.ray.kill(r["handle"], no_restart=False)
                except Exception as e:
                    log(f"replica {r['index']}: kill failed: {e}")
                with self.lock:
                    r["addr"], r["failures"] = None, 0

    def mark_failed(self, addr):
        with self.lock:
            for r in self.replicas:
                if r["addr"] == addr:
                    r["healthy"] = False

    def pick(self, tried):
        """The next healthy replica's address not in `tried`, round robin."""
        with self.lock:
            n = len(self.replicas)
            for k in range(n):
                r = self.replicas[(self.next + k) % n]
                if r["healthy"] and r["addr"] and r["addr"] not in tried:
                    self.next = (self.next + k + 1) % n
                    return r["addr"]
        return None

    def any_healthy(self):
        with self.lock:
            return any(r["healthy"] for r in self.replicas)

    def snapshot(self):
        with self.lock:
            return [
                {k: r[k] for k in ("index", "addr", "pid", "healthy", "restarts")}
                for r in self.replicas
            ]


def log(message):
    print(f"ray_serve: {message}", file=sys.stderr, flush=True)


def make_handler(pool, args):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def reply_json(self, status, doc):
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def error(self, status, message):
            self.reply_json(
                status,
                {
                    "error": {
                        "message": message,
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                },
            )

        def do_GET(self):
            if self.path == "/health":
                if pool.any_healthy():
                    self.reply_json(200, {"status": "ok"})
                else:
                    self.error(503, "no replica is healthy")
            elif self.path == "/replicas":
                self.reply_json(200, {"replicas": pool.snapshot()})
            else:
                self.forward()

        def do_POST(self):
            self.forward()

        def forward(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {
                k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP
            }
            tried = set()
            while True:
                addr = pool.pick(tried)
                if addr is None:
                    self.error(503, "no replica could take the request")
                    return
                tried.add(addr)
                host, port = addr.rsplit(":", 1)
                try:
                    upstream = http.client.HTTPConnection(
                        host, int(port), timeout=args.request_timeout
                    )
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    first = response.read1(65536)
                except (OSError, http.client.HTTPException) as e:
                    # Nothing reached the client yet: the next replica takes it.
                    log(f"replica at {addr} failed before answering ({e}); retrying")
                    pool.mark_failed(addr)
                    continue
                self.relay(response, first)
                upstream.close()
                return

        def relay(self, response, first):
            """Sends the answer on as it comes, chunked (streams stay streams)."""
            self.send_response(response.status)
            for k, v in response.getheaders():
                if k.lower() not in HOP_BY_HOP:
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            data = first
            try:
                while data:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    data = response.read1(65536)
                self.wfile.write(b"0\r\n\r\n")
            except (OSError, http.client.HTTPException) as e:
                # The replica died mid-answer (or the client left): the answer ends here,
                # without the last chunk, so the client sees it cut.
                log(f"an answer was cut: {e}")

    return Handler


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main(argv):
    args = parse_args(argv)
    import ray

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False)
        if args.replica_host is None:
            args.replica_host = "127.0.0.1"
    actor_class = ray.remote(Replica)
    pool = Pool(ray, actor_class, args)
    # Wait until every replica has started once (loading a model takes a while).
    deadline = time.time() + 600
    while time.time() < deadline:
        pool.check()
        if all(r["healthy"] for r in pool.replicas):
            break
        time.sleep(0.2)
    else:
        log("not every replica started within 600 s")
        return 1
    server = Server((args.host, args.port), make_handler(pool, args))
    stop = threading.Event()

    def checker():
        while not stop.wait(args.health_interval):
            pool.check()

    threading.Thread(target=checker, daemon=True).start()

    def on_signal(signum, frame):
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    log(f"{args.replicas} replicas: " + ", ".join(r["addr"] for r in pool.replicas))
    server.serve_forever()
    for r in pool.replicas:
        try:
            ray.kill(r["handle"], no_restart=True)
        except Exception:
            pass
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
