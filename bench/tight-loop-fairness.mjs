// Tight-loop fairness of default mode (nestjs-locked) in 2 processes x 4 workers: `loops` loops of
// 2 s of bench/contender.ts's 'loop' on a fresh key each, printing Jain's index over the 8 workers and
// each process's acquisitions per loop (bench/results/ab-3-quiet-handover/tight-loop-fairness.json).
// Scenario 3 of `npm run bench` reads the same index from one loop per round; this repeats it.
// argv: buildDir (compiled by `npm run bench`: .bench-build) redisPort loops; the redis-server is yours.
import { fork } from 'node:child_process';
import { join, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import { performance } from 'node:perf_hooks';
const [build, port, loops] = process.argv.slice(2);
const url = `redis://127.0.0.1:${port}`;
// Scenario 3's own index and rounding (bench/stats.ts, compiled into the build dir).
const { jain, round } = await import(pathToFileURL(resolve(build, 'bench', 'stats.js')).href);
const out = [];
for (let l = 0; l < Number(loops); l++) {
  const key = `fair-probe:${process.pid}:${l}`;
  const kids = [0, 1].map((p) => fork(join(build, 'bench', 'contender.js'), ['nestjs-locked', url, key, '4', String(p)], { stdio: ['ignore', 'ignore', 'inherit', 'ipc'] }));
  const next = (c, type) => new Promise((res) => { const f = (m) => { if (m.type === type) { c.off('message', f); res(m); } }; c.on('message', f); });
  await Promise.all(kids.map((c) => next(c, 'ready')));
  const until = performance.timeOrigin + performance.now() + 2000;
  const replies = kids.map((c) => next(c, 'events'));
  for (const c of kids) c.send({ type: 'loop', until });
  const all = (await Promise.all(replies)).flatMap((m) => m.acquisitions);
  const per = new Map(); for (const a of all) per.set(a.worker, (per.get(a.worker) ?? 0) + 1);
  const counts = ['0:0','0:1','0:2','0:3','1:0','1:1','1:2','1:3'].map((w) => per.get(w) ?? 0);
  const byProc = [counts.slice(0, 4).reduce((a, b) => a + b), counts.slice(4).reduce((a, b) => a + b)];
  out.push({ jain: round(jain(counts), 3), byProc });
  for (const c of kids) c.send({ type: 'stop' });
  await Promise.all(kids.map((c) => new Promise((r) => c.once('exit', r))));
}
console.log(JSON.stringify(out));
