import { describe, expect, it } from '@jest/globals';
import { Injectable } from '@nestjs/common';
import { Locked, LockConfigurationError, LockKeyError, MAX_KEY_LENGTH } from '../../lib/index.js';
import { LockKeyTemplate } from '../../lib/decorators/lock-key.template.js';

describe('key templates', () => {
  const parse = (source: string, declared?: number) => LockKeyTemplate.parse(source, '@Locked on Orders.pay', declared);

  it.each([
    ['order:<0', /has an unclosed "<" at position 6/],
    ['order:<>', /has an empty placeholder "<>"/],
    ['order:<-1>', /argument index .* not "-1"/],
    ['order:<a>', /argument index .* not "a"/],
    ['order:<0..id>', /empty property name/],
    ['order:0>', /has a ">" without a matching "<" at position 7/],
    // Counted from the start of the template, not from the end of the placeholder before it.
    ['a:<0>:b>', /has a ">" without a matching "<" at position 7/],
    ['order:<<0>>', /"<" inside the placeholder/],
    ['order:{<0>}', /contains "\{" in its literal text/],
    ['order:<0>}', /contains "\}" in its literal text/],
    ['100%:<0>', /contains "%" in its literal text/],
    ['', /must be a non-empty string/],
    [42 as unknown as string, /must be a non-empty string; got 42/],
  ])('rejects %j when the class is defined', (source, message) => {
    expect(() => parse(source)).toThrow(LockConfigurationError);
    expect(() => parse(source)).toThrow(message);
    expect(() => parse(source)).toThrow(/@Locked on Orders\.pay/);
  });

  it('rejects a placeholder beyond the declared parameters, naming class, method and template', () => {
    expect(() => {
      @Injectable()
      class Orders {
        @Locked('order:<1>')
        async pay(id: string) {
          return id;
        }
      }
      return Orders;
    }).toThrow('@Locked on Orders.pay: key template "order:<1>" reads argument <1> but the method declares 1 parameter(s).');
  });

  it('rejects bad decorator options and several keys when the class is defined', () => {
    const define = (options: object, key: unknown = 'k:<0>') => () => {
      class Jobs {
        @Locked(key as string, options)
        async run(id: string) {
          return id;
        }
      }
      return Jobs;
    };
    expect(define({ onContention: 'queue' })).toThrow(/onContention must be 'wait', 'fail' or 'skip'; got "queue"/);
    expect(define({ waitMs: -1 })).toThrow(/@Locked on Jobs\.run: waitMs must be/);
    expect(define({ minHoldMs: 1.5 })).toThrow(/minHoldMs must be/);
    expect(define({ lease: 5 })).toThrow(/unknown option "lease"/);
    expect(define({}, [])).toThrow(/an array of key templates needs at least one template/);
    expect(define({}, ['a:<0>', 'b:<2>'])).toThrow(/reads argument <2> but the method declares 1 parameter/);
    expect(() => {
      class Static {
        @Locked('k')
        static run() {}
      }
      return Static;
    }).toThrow(/not a static method/);
  });

  it('reads arguments and property paths, and encodes values', () => {
    expect(parse('order:<0>').resolve([42])).toBe('order:42');
    expect(parse('t:<0.from.id>-<1>').resolve([{ from: { id: 'x' } }, 7n])).toBe('t:x-7');
    expect(parse('flag:<0>').resolve([false])).toBe('flag:false');
    expect(parse('v:<0>').resolve(['a%b:c{d}e'])).toBe('v:a%25b%3Ac%7Bd%7De');
    // Each reserved character is encoded on its own too, not only beside another one.
    expect(['%', ':', '{', '}'].map((c) => parse('v:<0>').resolve([`a${c}`]))).toEqual(['v:a%25', 'v:a%3A', 'v:a%7B', 'v:a%7D']);
    // A function's properties too (a class passed as an argument, say).
    expect(parse('job:<0.jobName>').resolve([Object.assign(() => undefined, { jobName: 'report' })])).toBe('job:report');
  });

  it('never lets two different argument lists of two templates share a key through ":"', () => {
    const a = parse('a:<0>').resolve(['b:c']);
    const b = parse('a:b:<0>').resolve(['c']);
    expect(a).toBe('a:b%3Ac');
    expect(b).toBe('a:b:c');
    expect(a).not.toBe(b);
    // Nor can a value fake an encoded sequence.
    expect(parse('a:<0>').resolve(['b%3Ac'])).toBe('a:b%253Ac');
  });

  it.each([
    [[undefined], /argument <0> is undefined/],
    [[null], /argument <0> is null/],
    [[{ id: 1 }], /argument <0> is an object \(Object\)/],
    [[[1, 2]], /argument <0> is an array/],
    [[() => 1], /argument <0> is a function/],
    [[NaN], /argument <0> is NaN/],
    [[''], /argument <0> is ""/],
  ])('refuses %j at call time with LockKeyError naming template, method and argument', (args, message) => {
    const template = parse('order:<0>');
    expect(() => template.resolve(args)).toThrow(LockKeyError);
    expect(() => template.resolve(args)).toThrow(message);
    expect(() => template.resolve(args)).toThrow(/@Locked on Orders\.pay: cannot build the lock key from template "order:<0>"/);
  });

  it('refuses a key longer than 1024 characters at call time, naming the method', () => {
    const template = parse('order:<0>');
    expect(template.resolve(['x'.repeat(MAX_KEY_LENGTH - 6)])).toHaveLength(MAX_KEY_LENGTH);
    expect(() => template.resolve(['x'.repeat(MAX_KEY_LENGTH - 5)])).toThrow(LockKeyError);
    expect(() => template.resolve(['x'.repeat(MAX_KEY_LENGTH - 5)])).toThrow(
      `@Locked on Orders.pay: a lock key must be at most ${MAX_KEY_LENGTH} characters; got ${MAX_KEY_LENGTH + 1}`,
    );
  });

  it('names the property path that led nowhere', () => {
    expect(() => parse('o:<0.customer.id>').resolve([{ customer: null }])).toThrow(
      /argument <0>\.customer is null, so it has no property "id"/,
    );
    expect(() => parse('o:<0.id>').resolve([{ id: { nested: 1 } }])).toThrow(/argument <0>\.id is an object/);
    expect(() => parse('o:<0.customer.id>').resolve([{ customer: {} }])).toThrow(/Placeholder <0\.customer\.id> needs a string/);
    // A path reads objects' (and functions') properties only, never a string's or a number's.
    expect(() => parse('o:<0.length>').resolve(['abc'])).toThrow(/argument <0> is "abc", so it has no property "length"/);
  });
});
