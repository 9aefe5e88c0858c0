import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { Cluster, Redis, type ClusterOptions } from 'ioredis';
import { freePort, RedisServer, until } from './redis-server.js';

const run = promisify(execFile);

/**
 * A private Redis Cluster for one test file: `masters` `redis-server --cluster-enabled yes`
 * processes (each with its bus on its own free port), joined by `redis-cli --cluster create`,
 * stopped by pid. With `replicas` (per master), `failover()` kills a master and waits until its
 * replica took its slots over.
 */
export class RedisCluster {
  private readonly clients: Cluster[] = [];

  private constructor(readonly servers: RedisServer[]) {}

  /** `args`: more `redis-server` arguments for every node, or a function that gives each node's (by its index). */
  static async start(masters = 3, replicas = 0, args: string[] | ((node: number) => Promise<string[]>) = []): Promise<RedisCluster> {
    const servers: RedisServer[] = [];
    try {
      for (let i = 0; i < masters * (1 + replicas); i++) {
        // A function: each attempt of RedisServer.start probes a new bus port (and the node's own ports).
        const nodeArgs = async () => {
          const bus = await freePort();
          const more = typeof args === 'function' ? await args(i) : args;
          return ['--cluster-enabled', 'yes', '--cluster-port', String(bus), '--cluster-config-file', `nodes-${bus}.conf`, '--cluster-node-timeout', '2000', ...more];
        };
        servers.push(await RedisServer.start(nodeArgs));
      }
      const nodes = servers.map((s) => `127.0.0.1:${s.port}`);
      await run('redis-cli', ['--cluster', 'create', ...nodes, '--cluster-replicas', String(replicas), '--cluster-yes'], { timeout: 30_000 });
      const cluster = new RedisCluster(servers);
      await cluster.settled();
      // Every node's id while all run: ownerOf() matches by id, also after a node was killed.
      for (const server of servers) cluster.ids.set(server, String(await cluster.node(server).cluster('MYID')));
      return cluster;
    } catch (error) {
      await Promise.all(servers.map((s) => s.stop()));
      throw error;
    }
  }

  get nodes(): { host: string; port: number }[] {
    return this.servers.map((s) => ({ host: '127.0.0.1', port: s.port }));
  }

  /** A Cluster client for the test's own use, closed by `stop()`. */
  client(options: ClusterOptions = {}): Cluster {
    const c = new Cluster(this.nodes, { ...options, redisOptions: { maxRetriesPerRequest: 1, disconnectTimeout: 100, ...options.redisOptions } });
    c.on('error', () => undefined);
    this.clients.push(c);
    return c;
  }

  /** A plain connection to one node (for CLUSTER commands: its shared inspection client, reused). */
  node(server: RedisServer): Redis {
    return server.shared();
  }

  /**
   * The node that serves `slot` now (as a running node sees it), found by its node id: the port a
   * node announces is not its own after `announcePorts`.
   */
  async ownerOf(slot: number): Promise<RedisServer> {
    const id = await this.ownerSeenBy(this.servers.find((s) => s.running)!, slot);
    const owner = this.servers.find((s) => this.ids.get(s) === id);
    if (owner) return owner;
    throw new Error(`slot ${slot} is served by ${id}, which is none of this cluster's servers`);
  }

  /** The id of the node that serves `slot`, as `server` sees it (CLUSTER SLOTS). */
  private async ownerSeenBy(server: RedisServer, slot: number): Promise<string> {
    const slots = (await this.node(server).cluster('SLOTS')) as unknown as [number, number, [string, number, string]][];
    const range = slots.find(([from, to]) => slot >= from && slot <= to);
    if (!range) throw new Error(`slot ${slot} is not served`);
    return range[2][2];
  }

  /**
   * Makes each node announce the port `ports` gives it instead of its own (CONFIG SET
   * cluster-announce-port), as a node behind a proxy or a NAT announces its public address: in
   * CLUSTER SLOTS, CLUSTER NODES and in MOVED / ASK redirections, so clients reach it there
   * without any address translation of their own. Resolves once every node lists only those ports.
   */
  async announcePorts(ports: Map<RedisServer, number>): Promise<void> {
    for (const [server, port] of ports) await this.node(server).config('SET', 'cluster-announce-port', String(port));
    const announced = new Set(ports.values());
    await this.untilEveryNode(
      async (server) => {
        const slots = (await this.node(server).cluster('SLOTS')) as unknown as [number, number, ...[string, number][]][];
        return slots.every(([, , ...nodes]) => nodes.every(([, port]) => announced.has(Number(port))));
      },
      (server) => `node ${server.port} listing the announced ports`,
    );
  }

  /**
   * Moves one slot, with its keys, from its owner to `target`, the way `redis-cli --cluster
   * reshard` does: IMPORTING / MIGRATING, MIGRATE of every key, then SETSLOT NODE on every node.
   */
  async migrateSlot(slot: number, target: RedisServer): Promise<void> {
    const source = await this.ownerOf(slot);
    if (source === target) return;
    const src = this.node(source);
    const dst = this.node(target);
    const srcId = this.ids.get(source)!;
    const dstId = this.ids.get(target)!;
    await dst.cluster('SETSLOT', slot, 'IMPORTING', srcId);
    await src.cluster('SETSLOT', slot, 'MIGRATING', dstId);
    for (;;) {
      const keys = (await src.cluster('GETKEYSINSLOT', slot, 100)) as string[];
      if (keys.length === 0) break;
      await src.migrate('127.0.0.1', target.port, '', 0, 5_000, 'KEYS', ...keys);
    }
    for (const server of this.servers) await this.node(server).cluster('SETSLOT', slot, 'NODE', dstId);
    // The target bumped its config epoch when it took the slot. Until a node has heard that epoch,
    // gossip from the source (whose epoch may be higher than the target's old one) can give the slot
    // back to the source in that node's view: seen once as the next migration asking the target to
    // import a slot it already owned. Settled when every node knows the target's epoch and owner.
    const epoch = /cluster_my_epoch:(\d+)/.exec(String(await dst.cluster('INFO')))?.[1];
    await this.untilEveryNode(
      async (server) => {
        const line = String(await this.node(server).cluster('NODES'))
          .split('\n')
          .find((l) => l.startsWith(`${dstId} `));
        return line?.split(' ')[6] === epoch && (await this.ownerSeenBy(server, slot)) === dstId;
      },
      (server) => `node ${server.port} seeing slot ${slot} on ${target.port} at epoch ${epoch}`,
    );
  }

  /** The replica of `master` (the first one, with `replicas` > 0). */
  async replicaOf(master: RedisServer): Promise<RedisServer> {
    const info = String(await this.node(master).info('replication'));
    const port = Number(/slave0:ip=[^,]+,port=(\d+)/.exec(info)?.[1]);
    const replica = this.servers.find((s) => s.port === port);
    if (!replica) throw new Error(`no replica of ${master.port}`);
    return replica;
  }

  /**
   * SIGKILLs the master serving `slot`; resolves to its replica once that serves the slot and every
   * running node reports `cluster_state:ok` (the cluster's own failover: node timeout, vote, promotion).
   */
  async failover(slot: number): Promise<RedisServer> {
    const old = await this.ownerOf(slot);
    const promoted = await this.replicaOf(old);
    await old.kill();
    await until(async () => (await this.ownerOf(slot)) === promoted, 30_000, `the replica ${promoted.port} never took slot ${slot} over`);
    await this.settled();
    return promoted;
  }

  async stop(): Promise<void> {
    for (const c of this.clients.splice(0)) c.disconnect();
    await Promise.all(this.servers.map((s) => s.stop()));
  }

  /** Every node's id (CLUSTER MYID), read by start(). */
  private readonly ids = new Map<RedisServer, string>();

  /** Resolves once every node reports `cluster_state:ok`. */
  private async settled(): Promise<void> {
    await this.untilEveryNode(async (server) => String(await this.node(server).cluster('INFO')).includes('cluster_state:ok'), (server) => `cluster on ${server.port} never became ok`);
  }

  /** Resolves once `check` holds on every running node, one node after the other (10 s each). */
  private async untilEveryNode(check: (server: RedisServer) => Promise<boolean>, what: (server: RedisServer) => string): Promise<void> {
    for (const server of this.servers.filter((s) => s.running)) await until(() => check(server), 10_000, what(server));
  }
}
