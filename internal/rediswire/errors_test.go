// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// Only errors that say Redis cannot serve count toward the breaker; an
// error reply about one call's keys says Redis is up.
func TestClassifyRedisErrors(t *testing.T) {
	r := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: r.Addr()})
	defer c.Close()
	ctx := context.Background()
	reply := func(msg string) error {
		return c.Eval(ctx, "return redis.error_reply(ARGV[1])", nil, msg).Err()
	}
	c.HSet(ctx, "h", "x", "1")
	closed := redis.NewClient(&redis.Options{Addr: r.Addr()})
	closed.Close()
	down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	defer down.Close()
	// A client without the password, whose command is longer than Redis
	// reads before AUTH (a decision's arguments are).
	locked := redistest.Start(t)
	locked.CLI("CONFIG", "SET", "requirepass", "pw")
	noAuth := redis.NewClient(&redis.Options{Addr: locked.Addr(), MaxRetries: -1})
	defer noAuth.Close()
	long := []any{"HSET", "h"}
	for i := range 20 {
		long = append(long, i, i)
	}
	for _, tc := range []struct {
		name string
		err  error
		want Kind
	}{
		{"WRONGTYPE", c.Get(ctx, "h").Err(), Answered},
		{"CROSSSLOT", reply("CROSSSLOT Keys in request don't hash to the same slot"), Answered},
		{"script error", c.Eval(ctx, "return redis.call('NOPE')", nil).Err(), Answered},
		{"bad reply", fmt.Errorf("%w: x", ErrBadReply), Answered},
		{"LOADING", reply("LOADING Redis is loading the dataset in memory"), Outage},
		{"MASTERDOWN", reply("MASTERDOWN Link with MASTER is down"), Outage},
		{"READONLY", reply("READONLY You can't write against a read only replica."), Outage},
		{"OOM", reply("OOM command not allowed when used memory > 'maxmemory'."), Outage},
		{"WRONGPASS", reply("WRONGPASS invalid username-password pair"), Outage},
		{"NOAUTH", noAuth.Do(ctx, "HSET", "h", "a", "1").Err(), Outage},
		{"unauthenticated, long", noAuth.Do(ctx, long...).Err(), Outage},
		{"dial", down.Ping(ctx).Err(), Outage},
		{"timeout", context.DeadlineExceeded, Outage},
		{"closed client", closed.Ping(ctx).Err(), Unknown},
		{"pool timeout", fmt.Errorf("wrapped: %w", redis.ErrPoolTimeout), Unknown},
	} {
		if tc.err == nil {
			t.Fatalf("%s: no error to classify", tc.name)
		}
		if got := Classify(tc.err); got != tc.want {
			t.Errorf("%s (%v): kind %d, want %d", tc.name, tc.err, got, tc.want)
		}
	}
}

// Redis refusing the scripts is a kind of its own: to an ACL user
// without +evalsha or +eval (NOPERM, as Redis 6.2 to 7.2 word it, and
// Valkey as 7.2), as a server without the commands, or, on Valkey 9.1
// with its Lua module unloaded, without Lua. Other refusals keep their
// kind, and the reply logged keeps none of the arguments the server
// echoes.
func TestClassifyRefusedScripts(t *testing.T) {
	r := redistest.Start(t)
	r.CLI("ACL", "SETUSER", "limited", "on", ">pw", "~*", "+@all", "-eval", "-evalsha", "-script")
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: r.Addr()})
	defer c.Close()
	limited := redis.NewClient(&redis.Options{Addr: r.Addr(), Username: "limited", Password: "pw"})
	defer limited.Close()
	bare := redis.NewClient(&redis.Options{Addr: redistest.Start(t, "--rename-command", "EVALSHA", "").Addr()})
	defer bare.Close()
	const sha = "0123456789012345678901234567890123456789"
	reply := func(msg string) error {
		return c.Eval(ctx, "return redis.error_reply(ARGV[1])", nil, msg).Err()
	}
	// The NOPERM of the server the test runs, logged whole (the user it
	// names is no argument of the command): "this user" before Redis 7.2,
	// the user's name from 7.2 on and on Valkey.
	who := "this user"
	if err := limited.Eval(ctx, "return 1", nil).Err(); err != nil && strings.HasPrefix(err.Error(), "NOPERM User limited ") {
		who = "User limited"
	}
	noperm := func(cmd string) string {
		return "NOPERM " + who + " has no permissions to run the '" + cmd + "' command"
	}
	for _, tc := range []struct {
		name, logged string
		err          error
		want         Kind
	}{
		{"NOPERM evalsha", noperm("evalsha"), limited.EvalSha(ctx, sha, nil).Err(), Refused},
		{"NOPERM eval", noperm("eval"), limited.Eval(ctx, "return 1", nil).Err(), Refused},
		{"NOPERM, Redis 6.2", "NOPERM this user has no permissions to run the 'evalsha' command or its subcommand",
			reply("NOPERM this user has no permissions to run the 'evalsha' command or its subcommand"), Refused},
		{"NOPERM, Redis 7.2", "NOPERM User limited has no permissions to run the 'eval' command",
			reply("NOPERM User limited has no permissions to run the 'eval' command"), Refused},
		{"unknown command", "ERR unknown command 'evalsha'",
			bare.EvalSha(ctx, sha, []string{"rl:{1}secret"}).Err(), Refused},
		{"unknown command, Redis 6", "ERR unknown command `EVALSHA`",
			reply("ERR unknown command `EVALSHA`, with args beginning with: `x`, `1`, `rl:{1}secret`, "), Refused},
		{"no Lua", "ERR Could not find scripting engine 'lua'",
			reply("ERR Could not find scripting engine 'lua'"), Refused},
		{"NOPERM of another command", "", limited.ScriptFlush(ctx).Err(), Outage},
		{"NOPERM of a key", "", reply("NOPERM this user has no permissions to access one of the keys used as arguments"), Outage},
		{"another unknown command", "", reply("ERR unknown command 'evalshax', with args beginning with: "), Answered},
	} {
		if tc.err == nil {
			t.Fatalf("%s: no error to classify", tc.name)
		}
		if got := Classify(tc.err); got != tc.want {
			t.Errorf("%s (%v): kind %d, want %d", tc.name, tc.err, got, tc.want)
		}
		if logged, _ := scriptsRefused(tc.err); logged != tc.logged {
			t.Errorf("%s (%v): logged as %q, want %q", tc.name, tc.err, logged, tc.logged)
		}
	}
}

// A call is in doubt when it was sent and no answer came: Redis may run
// it when it can, as a frozen server does when it thaws. One that never
// left, or whose server died, is not.
func TestInDoubt(t *testing.T) {
	shape := NewShape(10*time.Second, time.Second, time.Second, 0, 0, 0, false) // burst 10, a token a second
	keys := Keys{Prefix: "doubt:"}
	hash, field, limit := keys.BucketLimit(ZoneField("z"), "k")
	take := func(c *Client) error {
		call := NewCall(Take, time.Now().Add(200*time.Millisecond))
		call.Bucket(hash, field, limit, shape, false, false)
		_, err := c.Run(context.Background(), call)
		return err
	}
	client := func(addr string) *Client {
		c, err := NewClient(&redis.UniversalOptions{Addrs: []string{addr}, MaxRetries: -1, ContextTimeoutEnabled: true,
			DialTimeout: 200 * time.Millisecond, ReadTimeout: 200 * time.Millisecond, WriteTimeout: 200 * time.Millisecond}, testScripts(t))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}

	// Sent to a frozen server, which runs it when it thaws: the bucket
	// then owes the second take's token too.
	r := redistest.Start(t)
	c := client(r.Addr())
	if err := take(c); err != nil {
		t.Fatal(err)
	}
	r.Pause()
	frozen := take(c)
	r.Resume()
	owes := func() time.Duration {
		at, _ := strconv.ParseInt(r.CLI("HGET", hash, field), 10, 64)
		redisNow, _ := strconv.ParseInt(r.CLI("EVAL", "local t = redis.call('TIME') return (t[1] - 1735689600) * 1000000000 + t[2] * 1000", "0"), 10, 64)
		return time.Duration(at - redisNow)
	}
	deadline := time.Now().Add(10 * time.Second)
	for owes() < 1500*time.Millisecond && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if d := owes(); d < 1500*time.Millisecond {
		t.Fatalf("after the thaw the bucket owes %v, want about 2s: the take that timed out was not run", d)
	}

	// Sent to a server that then died: it runs nothing later.
	dying := redistest.Start(t)
	dc := client(dying.Addr())
	if err := take(dc); err != nil {
		t.Fatal(err)
	}
	dying.Kill()
	dead := take(dc)

	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"sent to a frozen server", frozen, true},
		{"its server gone", dead, false},
		{"no server", take(client("127.0.0.1:1")), false},
		{"the deadline, dialling", context.DeadlineExceeded, false},
		{"the breaker open", ErrDown, false},
		{"no error", nil, false},
	} {
		if got := InDoubt(tc.err); got != tc.want {
			t.Errorf("%s (%v): in doubt %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
	if frozen == nil || frozen.Error() != frozen.(interface{ Unwrap() error }).Unwrap().Error() {
		t.Errorf("a call in doubt reads %v, as the error it wraps", frozen)
	}
}

// A timeout reading or writing a connection made is in doubt, however the
// client reports it; a dial's, or a context's, is not.
func TestSentAndLostClassifies(t *testing.T) {
	for _, tc := range []struct {
		err   error
		doubt bool
	}{
		{&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}, true},
		{&net.OpError{Op: "write", Net: "tcp", Err: os.ErrDeadlineExceeded}, true},
		{fmt.Errorf("reply: %w", os.ErrDeadlineExceeded), true}, // a connection of the client's own
		{&net.OpError{Op: "dial", Net: "tcp", Err: os.ErrDeadlineExceeded}, false},
		{context.DeadlineExceeded, false},
		{&net.OpError{Op: "read", Net: "tcp", Err: errors.New("connection reset by peer")}, false},
	} {
		if got := InDoubt(sentAndLost(tc.err)); got != tc.doubt {
			t.Errorf("%v: in doubt %v, want %v", tc.err, got, tc.doubt)
		}
	}
}
