// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package rediswire

import (
	"errors"
	"net"
	"os"
	"strings"

	"github.com/redis/go-redis/v9"
)

var (
	// ErrBadReply is a script reply that cannot be read: Redis answered,
	// so it says nothing of Redis's health.
	ErrBadReply = errors.New("redis script: bad reply")

	// ErrDown is returned while the circuit breaker is open.
	ErrDown = errors.New("redis is unavailable")
)

// A Kind is what a failed call says of Redis.
type Kind uint8

const (
	Outage   Kind = iota // Redis is unreachable, slow, or cannot serve
	Answered             // Redis answered, with an error about this call's keys
	Unknown              // the call never reached Redis: the client was closed, or its pool full
	Refused              // Redis answers, but will not run the scripts: no call can succeed until its ACL or its modules change
)

// outageReplies are the error replies that say Redis cannot serve at all:
// loading, failing over, read-only after a failover, out of memory, or
// refusing this client's credentials. Any other error reply belongs to
// the keys of one call (a wrong type, a slot error) and says that Redis
// is up.
var outageReplies = []string{
	"LOADING", "MASTERDOWN", "READONLY", "CLUSTERDOWN", "TRYAGAIN", "BUSY", "NOREPLICAS",
	"OOM", "NOAUTH", "WRONGPASS", "NOPERM", "MISCONF",
}

// Classify says what kind of failure err is.
func Classify(err error) Kind {
	if errors.Is(err, redis.ErrClosed) || errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrPoolExhausted) {
		return Unknown
	}
	if errors.Is(err, ErrBadReply) || errors.Is(err, ErrWindow) {
		return Answered
	}
	if _, ok := scriptsRefused(err); ok {
		return Refused
	}
	if reply, ok := errors.AsType[redis.Error](err); ok {
		if strings.Contains(reply.Error(), "unauthenticated") {
			// A command longer than Redis reads before AUTH: this
			// client's credentials, as NOAUTH says of a short one.
			return Outage
		}
		for _, prefix := range outageReplies {
			if redis.HasErrorPrefix(reply, prefix) {
				return Outage
			}
		}
		return Answered
	}
	return Outage // dial errors, timeouts, resets
}

// InDoubt reports whether a call that failed with err may have been run
// by Redis all the same: it was sent, or queued to be, and no answer came
// in time, so Redis may have run it, or may run it later (a frozen
// server runs what it had received when it thaws). A call that never
// left (the breaker open, a connection that could not be made, a closed
// client or a full pool), that Redis answered with an error, or whose
// connection Redis closed (a server that died runs nothing later) is not
// in doubt.
func InDoubt(err error) bool {
	_, ok := errors.AsType[unanswered](err)
	return ok
}

// unanswered is the error of a call sent, or queued to be, that timed
// out waiting for its answer. It reads as the error it wraps.
type unanswered struct{ error }

func (e unanswered) Unwrap() error { return e.error }

// sentAndLost is err, the failure of a call handed to the client, marked
// unanswered when the client wrote it, or began to, and its answer did
// not come in time: a read or a write that timed out. A call that found
// no connection fails otherwise (the client dials until the deadline,
// then says so: context.DeadlineExceeded), and so does one whose server
// closed the connection.
func sentAndLost(err error) error {
	if op, ok := errors.AsType[*net.OpError](err); ok {
		if (op.Op == "read" || op.Op == "write") && op.Timeout() {
			return unanswered{err}
		}
		return err
	}
	// go-redis returns some timeouts of a call's reply as
	// os.ErrDeadlineExceeded alone, not in a net.OpError (seen with
	// Valkey): a read that timed out all the same, as a dial's timeout
	// is a net.OpError.
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return unanswered{err}
	}
	return err
}

// scriptCommands are the commands by which the store runs its scripts:
// EVALSHA, and EVAL when Redis lacks the script (NOSCRIPT).
var scriptCommands = []string{"evalsha", "eval"}

// scriptsRefused reports whether err is Redis refusing the scripts, and
// returns its reply without the arguments it may echo (a client's key
// among them): this user may not run them (an ACL without +evalsha or
// +eval: NOPERM, naming the command), the server has no such command
// (built without scripting, or the command renamed away), or no Lua to
// run them (Valkey 9.1 with its Lua module unloaded has no script,
// NOSCRIPT, then refuses the EVAL that sends it).
func scriptsRefused(err error) (string, bool) {
	reply, ok := errors.AsType[redis.Error](err)
	if !ok {
		return "", false
	}
	msg := reply.Error()
	if strings.HasPrefix(msg, "ERR Could not find scripting engine") {
		return msg, true
	}
	named := ""
	if rest, ok := strings.CutPrefix(msg, "NOPERM "); ok {
		_, named, _ = strings.Cut(rest, "to run the ")
	} else if rest, ok := strings.CutPrefix(msg, "ERR unknown command "); ok {
		named = rest
		msg, _, _ = strings.Cut(msg, ", with args")
	}
	// The command is quoted, '...' (or `...` before Redis 7).
	if len(named) < 2 || named[0] != '\'' && named[0] != '`' {
		return "", false
	}
	cmd, _, _ := strings.Cut(named[1:], named[:1])
	for _, c := range scriptCommands {
		if strings.EqualFold(cmd, c) {
			return msg, true
		}
	}
	return "", false
}
