// `npm run bench:report`: rewrites BENCHMARKS.md from what is recorded in bench/results
// (latest.json, and the profile and instruction files the report quotes), measuring nothing. For
// after `npm run bench:profile` or `npm run bench:instructions` wrote new files there, so the
// report quotes them without another full `npm run bench`.
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { writeReport } from './report.js';
import { repoRoot } from '../test/support/paths.js';

writeReport(JSON.parse(readFileSync(join(repoRoot, 'bench', 'results', 'latest.json'), 'utf8')), join(repoRoot, 'BENCHMARKS.md'));
console.log('wrote BENCHMARKS.md from bench/results/latest.json');
