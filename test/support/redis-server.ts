import { execFile, spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { connect, createServer, type Server, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { Redis } from 'ioredis';
import { track } from './children.js';
import { repoRoot } from './paths.js';

/**
 * A private `redis-server` for one test file: started on a free loopback port, with nothing saved
 * to disk, stopped by pid. Tests never touch a server they did not start.
 */
export class RedisServer {
  private child: ChildProcess | undefined;
  private readonly dir = mkdtempSync(join(tmpdir(), 'nestjs-locked-redis-'));
  private readonly clients: Redis[] = [];

  private constructor(
    readonly port: number,
    private readonly extraArgs: string[],
    private readonly binary: string,
  ) {}

  /**
   * Starts a server on a free port and resolves once it accepts connections. `extraArgs` may be a
   * function, called again on each attempt, for arguments that name more ports of their own.
   * `binary` is the server to run: the `redis-server` on the PATH unless told.
   */
  static start(extraArgs: string[] | (() => Promise<string[]>) = [], binary = 'redis-server'): Promise<RedisServer> {
    return onFreePort(async (port) => {
      const server = new RedisServer(port, typeof extraArgs === 'function' ? await extraArgs() : extraArgs, binary);
      await server.launch();
      return server;
    });
  }

  get url(): string {
    return `redis://127.0.0.1:${this.port}`;
  }

  get pid(): number | undefined {
    return this.child?.pid;
  }

  get running(): boolean {
    return this.child !== undefined;
  }

  /** One client for the test's own inspection, made on first use and reused (by polls too), closed by `stop()`. */
  shared(): Redis {
    this.sharedClient ??= this.client();
    return this.sharedClient;
  }
  private sharedClient: Redis | undefined;

  /** A client for the test's own inspection, closed by `stop()`. */
  client(): Redis {
    const c = new Redis(this.port, '127.0.0.1', { lazyConnect: false, maxRetriesPerRequest: 1, disconnectTimeout: 100 });
    c.on('error', () => undefined);
    this.clients.push(c);
    return c;
  }

  /** Starts the server process on this server's port (again, after `kill()`). */
  async launch(): Promise<void> {
    if (this.child) throw new Error('redis-server already running');
    const child = spawnUntilReady(
      ['--port', String(this.port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--dir', this.dir, '--daemonize', 'no', ...this.extraArgs],
      'Ready to accept connections',
      `redis-server on port ${this.port}`,
      this.binary,
    );
    this.child = child.process;
    child.process.once('exit', () => {
      if (this.child === child.process) this.child = undefined;
    });
    await child.ready;
  }

  /** Kills the process (SIGKILL: nothing is saved) and waits until it is gone. */
  async kill(): Promise<void> {
    await this.signal('SIGKILL');
  }

  /** Freezes the process (SIGSTOP): connections stay open, nothing answers. */
  pause(): void {
    this.child?.kill('SIGSTOP');
  }

  resume(): void {
    this.child?.kill('SIGCONT');
  }

  /** Stops the server by pid and closes the test's clients. */
  async stop(): Promise<void> {
    for (const c of this.clients.splice(0)) c.disconnect();
    this.resume();
    await this.signal('SIGTERM');
    rmSync(this.dir, { recursive: true, force: true });
  }

  private async signal(sig: NodeJS.Signals): Promise<void> {
    const child = this.child;
    if (!child) return;
    const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
    child.kill(sig);
    const timer = setTimeout(() => child.kill('SIGKILL'), 5_000);
    await exited;
    clearTimeout(timer);
  }
}

/**
 * Spawns `redis-server args` (a server or, with `--sentinel`, a sentinel), registered as `what` with
 * `track` (children.ts): a test file that leaves it running fails, and it is killed. `ready`
 * resolves once its log shows `marker`, and rejects if it exits first.
 */
export function spawnUntilReady(args: string[], marker: string, what: string, binary = 'redis-server'): { process: ChildProcess; ready: Promise<void> } {
  const child = spawn(binary, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  track(child, what);
  const ready = new Promise<void>((resolve, reject) => {
    let log = '';
    const onData = (chunk: Buffer) => {
      log += chunk.toString();
      if (log.includes(marker)) {
        child.stdout!.off('data', onData);
        child.stdout!.resume();
        child.stderr!.resume();
        resolve();
      }
    };
    child.stdout!.on('data', onData);
    child.once('exit', (code) => reject(new Error(`${what} exited (${code}) before it was ready:\n${log}`)));
    child.once('error', reject);
  });
  return { process: child, ready };
}

/** How many connections are subscribed to the release channel of `key` (default prefix `lock:`). */
export async function subscribers(raw: Redis, key: string): Promise<number> {
  return Number(((await raw.pubsub('NUMSUB', `lock:{${key}}`)) as unknown[])[1]);
}

/** Redis's clock in milliseconds (TIME), the clock of the fair queue's and waiting writers' place deadlines. */
export async function redisNowMs(raw: Redis): Promise<number> {
  const [s, us] = await raw.time();
  return Number(s) * 1000 + Math.floor(Number(us) / 1000);
}

/** Resolves once `check` resolves true (a throwing check counts as false), polling every 50 ms; rejects after `ms`. */
export async function until(check: () => Promise<boolean>, ms: number, what: string): Promise<void> {
  const end = Date.now() + ms;
  for (;;) {
    if (await check().catch(() => false)) return;
    if (Date.now() > end) throw new Error(`${what} within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/**
 * How often a server ran each of `commands` (lower case) since its statistics were last reset,
 * whether clients sent them or scripts called them (`INFO commandstats`).
 */
export async function commandCalls<C extends string>(client: Redis, ...commands: C[]): Promise<Record<C, number>> {
  const stats = await client.info('commandstats');
  return Object.fromEntries(commands.map((c) => [c, Number(new RegExp(`cmdstat_${c}:calls=(\\d+)`).exec(stats)?.[1] ?? 0)])) as Record<C, number>;
}

/** How many scripts (EVALSHA and EVAL) a server has run since its statistics were last reset. */
export async function scriptCalls(client: Redis): Promise<number> {
  const { evalsha, eval: evals } = await commandCalls(client, 'evalsha', 'eval');
  return evalsha + evals;
}

/**
 * Whether a replica of `master` acknowledges writes now: a write made on it is confirmed by `WAIT 1`
 * (what the lock module's replica confirmation asks). Being listed as online in the master's INFO,
 * or `master_link_status:up` on the replica, is not enough: Redis 7.0 marks a replica online when a
 * diskless transfer ends, before its first ACK, and clean-clone CI runs saw a WAIT get no
 * acknowledgement within 400 ms right then (after a Sentinel rejoin, and at start).
 */
export async function replicaAcknowledges(master: Redis): Promise<boolean> {
  if (!/slave0:.*state=online/.test(String(await master.info('replication')))) return false;
  await master.set('harness:acknowledged', '1');
  const acknowledged = Number(await master.wait(1, 200)) === 1;
  await master.del('harness:acknowledged');
  return acknowledged;
}

/**
 * Runs `start` on a free port, and again on another (up to 5 attempts) when it fails: another process,
 * or an outgoing connection's local port, may take a port between probing and binding.
 */
export async function onFreePort<T>(start: (port: number) => Promise<T>): Promise<T> {
  for (let attempt = 0; ; attempt++) {
    try {
      return await start(await freePort());
    } catch (error) {
      if (attempt >= 4) throw error;
    }
  }
}

/** A TCP port free on 127.0.0.1 right now. */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.unref();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const address = server.address();
      server.close(() => (typeof address === 'object' && address ? resolve(address.port) : reject(new Error('no port'))));
    });
  });
}

/**
 * A loopback port that accepts connections and never answers, held until `close()`: a Redis that
 * does not answer. Unlike a merely free port, no other test's redis-server can take it meanwhile.
 * `connections` counts the clients still connected.
 */
export async function silentPort(): Promise<{ port: number; readonly connections: number; close(): Promise<void> }> {
  const sockets = new Set<Socket>();
  const server = createServer((socket) => {
    sockets.add(socket);
    socket.on('close', () => sockets.delete(socket));
    socket.on('error', () => undefined);
    socket.resume(); // reads (and ignores) what the client sends, so its close is seen
  });
  const port = await listenOnLoopback(server);
  return {
    port,
    get connections() {
      return sockets.size;
    },
    close: () => closeServer(server, sockets),
  };
}

/** What a server says it is, as "Redis 7.0.15" or "Valkey 8.1.1" (INFO server). */
export async function serverIdentity(client: Redis): Promise<string> {
  const info = String(await client.info('server'));
  const field = (name: string) => new RegExp(`^${name}:(\\S+)`, 'm').exec(info)?.[1];
  return field('server_name') === 'valkey' ? `Valkey ${field('valkey_version')}` : `Redis ${field('redis_version')}`;
}

/**
 * The server a run's tests must be starting: LOCK_TEST_SERVER (the Redis 8 and Valkey 8 runs, which
 * put that server's wrappers first on the PATH: scripts/redis-servers.mjs), else the redis-server
 * on the PATH.
 */
export function expectedServer(): string {
  if (process.env.LOCK_TEST_SERVER) return process.env.LOCK_TEST_SERVER;
  const onPath = /^(Redis|Valkey) server v=(\S+)/.exec(spawnSync('redis-server', ['--version'], { encoding: 'utf8' }).stdout);
  return `${onPath?.[1]} ${onPath?.[2]}`;
}

/** Whether `redis-server` is on the PATH. */
export function redisServerAvailable(): boolean {
  return spawnSync('redis-server', ['--version'], { stdio: 'ignore' }).status === 0;
}

/**
 * A TCP proxy on a free loopback port to `targetPort`, for a link whose traffic a test must stall:
 * `hold()` stops passing on what the target sends, `hold('both')` what either side sends (never
 * delivered), while the connections stay open, as a congested or partitioned link looks to its
 * ends. `bytesFromClients` counts what the clients sent, passed on or not. When the target closes a connection, the proxy closes the other side too.
 */
export async function tcpProxy(
  targetPort: number,
  /** Changes what the target sends before it is passed on (a reply Redis cannot be made to give). */
  rewrite: (data: Buffer) => Buffer = (data) => data,
): Promise<{
  port: number;
  readonly bytesFromClients: number;
  /** How many commands the clients sent, passed on or not (RESP arrays; no argument here holds a CRLF). */
  readonly commandsFromClients: number;
  hold(direction?: 'from-target' | 'both'): void;
  /**
   * Passes everything until a client sends a command named `command` (or with `command` as an
   * argument of its own, such as a script's SHA in EVALSHA), then holds Redis's replies from that
   * one on (as `hold()`).
   */
  holdRepliesFrom(command: string): void;
  /** As `holdRepliesFrom`, but keeps the replies instead of dropping them, until `passDelayed()`. */
  delayRepliesFrom(command: string): void;
  /** How many reply lines (each ending in CRLF) `delayRepliesFrom` has kept so far. */
  readonly delayedLines: number;
  /**
   * Sends the replies `delayRepliesFrom` kept, in order, and passes everything again. With
   * `linesApartMs`, it sends them, and everything the target sends after them, one line at a time
   * that many ms apart, so that each reply reaches the client in a read of its own.
   */
  passDelayed(linesApartMs?: number): void;
  cut(): void;
  /** Cuts every connection, as `cut()`, and closes each new one as soon as it opens, until `cutAfterReadyCheck()`. */
  down(): void;
  /**
   * Lets connections open again. The next one passes everything until Redis has answered its
   * client's INFO (the ready check ioredis sends before it counts a connection ready), then it is
   * closed at once: the client reads that reply and writes to a connection whose other end is gone.
   * The ones after it pass everything.
   */
  cutAfterReadyCheck(): void;
  close(): Promise<void>;
}> {
  const sockets = new Set<Socket>();
  // Redis's replies: passed on, dropped (held), or kept until passDelayed(); from a client's next
  // command named `trigger.command` on, they become `trigger.then`.
  let replies: 'pass' | 'drop' | 'keep' | 'drip' = 'pass';
  // Drip mode: lines still to send, one per `dripMs`.
  let dripMs = 0;
  const dripping: { to: Socket; line: Buffer }[] = [];
  let dripTimer: NodeJS.Timeout | undefined;
  const dripNext = (): void => {
    const item = dripping.shift();
    if (!item) return void (dripTimer = undefined);
    item.to.write(item.line);
    dripTimer = setTimeout(dripNext, dripMs);
  };
  const drip = (to: Socket, data: Buffer): void => {
    let start = 0;
    for (let end = data.indexOf('\r\n'); end !== -1; end = data.indexOf('\r\n', start)) {
      dripping.push({ to, line: data.subarray(start, end + 2) });
      start = end + 2;
    }
    if (start < data.length) dripping.push({ to, line: data.subarray(start) });
    dripTimer ??= setTimeout(dripNext, 0);
  };
  let trigger: { command: string; then: 'drop' | 'keep' } | undefined;
  const delayed: { to: Socket; data: Buffer }[] = [];
  let holdingBoth = false;
  let bytesFromClients = 0;
  let commandsFromClients = 0;
  let refusing = false;
  let cutNextAfterInfo = false;
  const server = createServer((downstream) => {
    if (refusing) {
      downstream.on('error', () => undefined);
      return void downstream.destroy();
    }
    // cutAfterReadyCheck(): 'armed' until the client sends INFO, 'asked' until Redis's reply
    // starts, then the reply's bytes still to pass before the connection is cut.
    let afterInfo: 'no' | 'armed' | 'asked' | number = cutNextAfterInfo ? 'armed' : 'no';
    cutNextAfterInfo = false;
    const upstream = connect(targetPort, '127.0.0.1');
    for (const s of [downstream, upstream]) {
      sockets.add(s);
      s.on('error', () => undefined);
      s.on('close', () => {
        sockets.delete(s);
        downstream.destroy();
        upstream.destroy();
      });
    }
    downstream.on('data', (d) => {
      const text = d.toString('latin1');
      bytesFromClients += d.length;
      commandsFromClients += text.match(/(?:^|\r\n)\*\d+\r\n/g)?.length ?? 0;
      if (afterInfo === 'armed' && text.toLowerCase().includes('\r\ninfo\r\n')) afterInfo = 'asked';
      // A RESP command name (or argument) is a bulk string on its own line: \r\n<name>\r\n.
      if (trigger && text.toLowerCase().includes(`\r\n${trigger.command}\r\n`)) {
        replies = trigger.then;
        trigger = undefined;
      }
      if (!holdingBoth) upstream.write(d);
    });
    upstream.on('data', (raw: Buffer) => {
      if (afterInfo !== 'no' && afterInfo !== 'armed') {
        // INFO's reply is one bulk (RESP2 $) or verbatim (RESP3 =) string: <type><length>\r\n<length bytes>\r\n.
        if (afterInfo === 'asked') {
          const header = raw.indexOf('\r\n');
          afterInfo = header + 2 + Number(raw.subarray(1, header).toString('latin1')) + 2;
        }
        downstream.write(raw);
        afterInfo -= raw.length;
        if (afterInfo <= 0) {
          afterInfo = 'no';
          downstream.destroy();
          upstream.destroy();
        }
        return;
      }
      const d = rewrite(raw);
      if (replies === 'keep') delayed.push({ to: downstream, data: d });
      else if (replies === 'drip') drip(downstream, d);
      else if (replies === 'pass') downstream.write(d);
    });
  });
  const port = await listenOnLoopback(server);
  const cut = (): void => {
    clearTimeout(dripTimer);
    dripTimer = undefined;
    dripping.length = 0;
    for (const socket of sockets) socket.destroy();
    replies = 'pass';
    trigger = undefined;
    delayed.length = 0;
    holdingBoth = false;
  };
  return {
    port,
    get bytesFromClients() {
      return bytesFromClients;
    },
    get commandsFromClients() {
      return commandsFromClients;
    },
    hold: (direction = 'from-target') => {
      replies = 'drop';
      holdingBoth = direction === 'both';
    },
    holdRepliesFrom: (command) => {
      trigger = { command: command.toLowerCase(), then: 'drop' };
    },
    delayRepliesFrom: (command) => {
      trigger = { command: command.toLowerCase(), then: 'keep' };
    },
    get delayedLines() {
      return delayed.reduce((lines, { data }) => lines + data.toString('latin1').split('\r\n').length - 1, 0);
    },
    passDelayed: (linesApartMs) => {
      if (linesApartMs === undefined) {
        replies = 'pass';
        for (const { to, data } of delayed.splice(0)) to.write(data);
        return;
      }
      replies = 'drip';
      dripMs = linesApartMs;
      for (const { to, data } of delayed.splice(0)) drip(to, data);
    },
    cut,
    down: () => {
      refusing = true;
      cut();
    },
    cutAfterReadyCheck: () => {
      refusing = false;
      cutNextAfterInfo = true;
    },
    close: () => {
      clearTimeout(dripTimer);
      return closeServer(server, sockets);
    },
  };
}

/**
 * A real Redis older than nestjs-locked supports, started like any other: Redis 6.0 as Debian 11
 * ships it, fetched from Debian's archive on first use (`node scripts/redis-servers.mjs redis6`;
 * REDIS_6_0 names a directory of its binaries instead). Resolves with its version.
 */
export async function olderRedis(): Promise<{ server: RedisServer; version: string }> {
  const script = join(repoRoot, 'scripts', 'redis-servers.mjs');
  // Not execFileSync: the event loop goes on meanwhile (a test's locks keep renewing).
  const { stdout } = await promisify(execFile)(process.execPath, [script, 'redis6'], { encoding: 'utf8' });
  const { bin, version } = JSON.parse(stdout) as { bin: string; version: string };
  return { server: await RedisServer.start([], join(bin, 'redis-server')), version };
}

/**
 * A proxy to `server` whose INFO reports another Redis version (`claimed`) instead of the real one,
 * for the versions no Debian release ships (6.1, 6.2): the version string is rewritten at the same
 * length, so the reply stays well formed. INFO's reply comes in one piece on loopback.
 */
export async function olderRedisProxy(server: RedisServer, claimed: string): Promise<{ port: number; version: string; close(): Promise<void> }> {
  const actual = /redis_version:(\S+)/.exec(String(await server.client().info('server')))![1]!;
  const version = claimed.padEnd(actual.length, '0').slice(0, actual.length);
  const from = Buffer.from(`redis_version:${actual}\r\n`);
  const to = Buffer.from(`redis_version:${version}\r\n`);
  const proxy = await tcpProxy(server.port, (data) => {
    const at = data.indexOf(from);
    return at < 0 ? data : Buffer.concat([data.subarray(0, at), to, data.subarray(at + from.length)]);
  });
  return { port: proxy.port, version, close: () => proxy.close() };
}

/** Listens on a free loopback port; resolves to that port. */
async function listenOnLoopback(server: Server): Promise<number> {
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(0, '127.0.0.1', resolve);
  });
  const address = server.address();
  if (typeof address !== 'object' || !address) throw new Error('no port');
  return address.port;
}

/** Destroys the server's open sockets, then closes it. */
async function closeServer(server: Server, sockets: Set<Socket>): Promise<void> {
  for (const socket of sockets) socket.destroy();
  await new Promise((resolve) => server.close(resolve));
}
