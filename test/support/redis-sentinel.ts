import type { ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Redis } from 'ioredis';
import { onFreePort, RedisServer, replicaAcknowledges, spawnUntilReady, tcpProxy, until } from './redis-server.js';

const MASTER_NAME = 'locks';

/**
 * A private Sentinel deployment for one test file: a master, one replica, and 3 sentinels
 * (quorum 2, down-after 500 ms), all on free loopback ports, stopped by pid. `failover()` kills the
 * master and resolves once the sentinels promoted the replica.
 */
export class RedisSentinelSet {
  private readonly sentinelClients = new Map<SentinelProcess, Redis>();

  private constructor(
    public master: RedisServer,
    public replica: RedisServer,
    private readonly sentinels: SentinelProcess[],
    private readonly link: { hold(): void; close(): Promise<void> } | undefined,
  ) {}

  readonly name = MASTER_NAME;

  /**
   * `replicationProxy`: the replica reaches the master through a TCP proxy, so `holdReplication()`
   * can stall its link (the sentinels' failover timeout is then 60 s instead of 5 s, so they do not
   * "fix" the replica to the master's own address, which they do after twice that timeout).
   */
  static async start(options: { replicationProxy?: boolean } = {}): Promise<RedisSentinelSet> {
    const master = await RedisServer.start();
    const started: { stop(): Promise<void> }[] = [master];
    try {
      const link = options.replicationProxy ? await tcpProxy(master.port) : undefined;
      if (link) started.push({ stop: () => link.close() });
      const replica = await RedisServer.start(['--replicaof', '127.0.0.1', String(link?.port ?? master.port)]);
      started.push(replica);
      const sentinels: SentinelProcess[] = [];
      for (let i = 0; i < 3; i++) {
        const s = await SentinelProcess.start(master.port, link ? 60_000 : 5_000);
        sentinels.push(s);
        started.push(s);
      }
      const set = new RedisSentinelSet(master, replica, sentinels, link);
      // Ready when the replica acknowledges writes and every sentinel knows the replica and the 2 other sentinels.
      await until(async () => {
        if (!(await replicaAcknowledges(set.direct(master)))) return false;
        for (const s of sentinels) {
          const fields = (await set.sentinelClient(s).call('SENTINEL', 'MASTER', MASTER_NAME)) as string[];
          const get = (f: string) => Number(fields[fields.indexOf(f) + 1]);
          if (get('num-slaves') < 1 || get('num-other-sentinels') < 2) return false;
        }
        return true;
      }, 20_000, 'the sentinels never saw the replica and each other');
      return set;
    } catch (error) {
      await Promise.all(started.map((s) => s.stop()));
      throw error;
    }
  }

  /** The sentinels' addresses, as ioredis `sentinels` takes them. */
  get nodes(): { host: string; port: number }[] {
    return this.sentinels.map((s) => ({ host: '127.0.0.1', port: s.port }));
  }

  /** The port the sentinels report for the master now. */
  async masterPort(): Promise<number> {
    const [, port] = (await this.sentinelClient(this.sentinels[0]!).call('SENTINEL', 'GET-MASTER-ADDR-BY-NAME', MASTER_NAME)) as [string, string];
    return Number(port);
  }

  /**
   * From now on the replica receives nothing more from the master (the connection stays open, so
   * neither side nor the sentinels see a broken link): writes after this are missing on it, as
   * asynchronous replication can leave them when a master dies. Needs `replicationProxy`.
   */
  holdReplication(): void {
    if (!this.link) throw new Error('start the set with { replicationProxy: true }');
    this.link.hold();
  }

  /** SIGKILLs the master; resolves once the sentinels report the replica as master and it accepts writes. */
  async failover(): Promise<void> {
    const old = this.master;
    await old.kill();
    await until(async () => (await this.masterPort()) === this.replica.port && (String(await this.direct(this.replica).info('replication'))).includes('role:master'), 30_000, 'no promotion');
    [this.master, this.replica] = [this.replica, old];
  }

  /** Starts the old master again: the sentinels turn it into a replica of the new one. Resolves once it acknowledges writes. */
  async rejoin(): Promise<void> {
    await this.replica.launch();
    await until(() => replicaAcknowledges(this.direct(this.master)), 30_000, 'the old master never rejoined as a replica that acknowledges writes');
  }

  /** A plain connection to one data server (its shared inspection client, reused by polls). */
  direct(server: RedisServer): Redis {
    return server.shared();
  }

  async stop(): Promise<void> {
    for (const c of this.sentinelClients.values()) c.disconnect();
    this.sentinelClients.clear();
    await Promise.all(this.sentinels.map((s) => s.stop()));
    await Promise.all([this.master.stop(), this.replica.stop()]);
    await this.link?.close();
  }

  private sentinelClient(s: SentinelProcess): Redis {
    let c = this.sentinelClients.get(s);
    if (!c) {
      c = new Redis(s.port, '127.0.0.1', { maxRetriesPerRequest: 1, disconnectTimeout: 100 });
      c.on('error', () => undefined);
      this.sentinelClients.set(s, c);
    }
    return c;
  }
}

/** One `redis-server --sentinel` with its own writable config file. */
class SentinelProcess {
  private constructor(
    readonly port: number,
    private readonly child: ChildProcess,
    private readonly dir: string,
  ) {}

  static start(masterPort: number, failoverTimeoutMs: number): Promise<SentinelProcess> {
    return onFreePort((port) => SentinelProcess.startOn(port, masterPort, failoverTimeoutMs));
  }

  private static async startOn(port: number, masterPort: number, failoverTimeoutMs: number): Promise<SentinelProcess> {
    const dir = mkdtempSync(join(tmpdir(), 'nestjs-locked-sentinel-'));
    const conf = join(dir, 'sentinel.conf');
    writeFileSync(
      conf,
      [
        `port ${port}`,
        'bind 127.0.0.1',
        `dir ${dir}`,
        `sentinel monitor ${MASTER_NAME} 127.0.0.1 ${masterPort} 2`,
        `sentinel down-after-milliseconds ${MASTER_NAME} 500`,
        `sentinel failover-timeout ${MASTER_NAME} ${failoverTimeoutMs}`,
        `sentinel parallel-syncs ${MASTER_NAME} 1`,
        '',
      ].join('\n'),
    );
    const child = spawnUntilReady([conf, '--sentinel'], '+monitor master', `sentinel on port ${port}`);
    const s = new SentinelProcess(port, child.process, dir);
    try {
      await child.ready;
    } catch (error) {
      await s.stop();
      throw error;
    }
    return s;
  }

  async stop(): Promise<void> {
    if (this.child.exitCode === null && this.child.signalCode === null) {
      const exited = new Promise<void>((resolve) => this.child.once('exit', () => resolve()));
      this.child.kill('SIGKILL');
      await exited;
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}
