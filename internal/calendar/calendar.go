// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

// Package calendar is the windows of calendar quotas: days, ISO weeks
// and months from midnight in a time zone, daylight saving time
// included. It knows nothing of quotas, keys or stores.
package calendar

import (
	"sync/atomic"
	"time"
)

// A Period is the length of a calendar window.
type Period uint8

const (
	day Period = iota + 1
	week
	month
)

// Periods are the periods by their names in a config.
var Periods = map[string]Period{"day": day, "week": week, "month": month}

// Window returns the calendar window of p that holds t, in loc: from
// midnight of its first day to midnight of the next window's first day.
// Around a change of daylight saving time a day has 23 or 25 hours; a
// midnight that the change skips is the first instant of that day.
func (p Period) Window(t time.Time, loc *time.Location) (start, end time.Time) {
	y, m, d := t.In(loc).Date()
	switch p {
	case week:
		d -= (int(time.Date(y, m, d, 12, 0, 0, 0, loc).Weekday()) + 6) % 7 // back to Monday
		return midnight(y, m, d, loc), midnight(y, m, d+7, loc)
	case month:
		return midnight(y, m, 1, loc), midnight(y, m+1, 1, loc)
	default:
		return midnight(y, m, d, loc), midnight(y, m, d+1, loc)
	}
}

// midnight is the first instant of a day in loc (d may overflow the
// month, as time.Date allows). Where a change of offset skips midnight
// (as America/Santiago's did), time.Date may give an instant of the day
// before: the day then starts at the change.
func midnight(y int, m time.Month, d int, loc *time.Location) time.Time {
	t := time.Date(y, m, d, 0, 0, 0, 0, loc)
	wy, wm, wd := time.Date(y, m, d, 0, 0, 0, 0, time.UTC).Date()
	if ty, tm, td := t.In(loc).Date(); ty != wy || tm != wm || td != wd {
		_, t = t.ZoneBounds()
	}
	return t
}

// A Window is a calendar window by this instance's clock, with the ones
// before and after: what a store needs to pick the window by its own
// clock.
type Window struct {
	Start, End time.Time // the window is [Start, End)
	Prev, Next time.Time // the previous window's start, the next one's end
	Seconds    int64     // its length in seconds, rounded up
}

// Windows are the windows of a period in a time zone.
type Windows struct {
	Period Period
	Loc    *time.Location
	// Every, when set, replaces the calendar with windows of this length
	// from the Unix epoch. Only tests set it: calendar windows last a day
	// at least.
	Every time.Duration
	cur   atomic.Pointer[Window] // the window last seen
}

// Window returns the window that holds now. Windows change once a day
// at most, so the last one is kept: the common call allocates nothing.
func (ws *Windows) Window(now time.Time) *Window {
	if w := ws.cur.Load(); w != nil && !now.Before(w.Start) && now.Before(w.End) {
		return w
	}
	w := ws.windowAt(now)
	ws.cur.Store(w)
	return w
}

// windowAt computes the window that holds now.
func (ws *Windows) windowAt(now time.Time) *Window {
	var prev, start, end, next time.Time
	if ws.Every > 0 {
		start = time.Unix(0, now.UnixNano()/int64(ws.Every)*int64(ws.Every))
		prev, end, next = start.Add(-ws.Every), start.Add(ws.Every), start.Add(2*ws.Every)
	} else {
		start, end = ws.Period.Window(now, ws.Loc)
		prev, _ = ws.Period.Window(start.Add(-time.Nanosecond), ws.Loc)
		_, next = ws.Period.Window(end, ws.Loc)
	}
	return &Window{Start: start, End: end, Prev: prev, Next: next, Seconds: int64((end.Sub(start) + time.Second - 1) / time.Second)}
}
