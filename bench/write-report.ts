// `npm run bench:report`: rewrites BENCHMARKS.md from what is recorded in bench/results
// (latest.json, and the profile and instruction files the report quotes), measuring nothing. For
// after `npm run bench:profile` or `npm run bench:instructions` wrote new files there, so the
// report quotes them without another full `npm run bench`.
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { writeReport } from './report.js';

const repoRoot = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
writeReport(JSON.parse(readFileSync(join(repoRoot, 'bench', 'results', 'latest.json'), 'utf8')), join(repoRoot, 'BENCHMARKS.md'));
console.log('wrote BENCHMARKS.md from bench/results/latest.json');
