// Copyright 2026 The caddy-tokenbucket Authors
// SPDX-License-Identifier: Apache-2.0

package calendar_test

import (
	"testing"
	"time"

	"github.com/caddy-tokenbucket/ratelimit/internal/calendar"
)

func mustLoad(t *testing.T, name string) *time.Location {
	t.Helper()
	loc, err := time.LoadLocation(name)
	if err != nil {
		t.Fatal(err)
	}
	return loc
}

// TestWindows checks the calendar windows at the boundaries that
// make calendars hard: month ends, leap years, year ends, ISO weeks
// across years, and days of 23 and 25 hours.
func TestWindows(t *testing.T) {
	paris := mustLoad(t, "Europe/Paris")
	newYork := mustLoad(t, "America/New_York")
	utc := time.UTC
	at := func(loc *time.Location, s string) time.Time {
		tm, err := time.ParseInLocation("2006-01-02 15:04:05.999999999", s, loc)
		if err != nil {
			t.Fatal(err)
		}
		return tm
	}
	for _, tc := range []struct {
		name       string
		p          calendar.Period
		loc        *time.Location
		at         string // in loc
		start, end string // in loc
		hours      float64
	}{
		{"day", calendar.Day, utc, "2026-12-01 04:38:45", "2026-12-01 00:00:00", "2026-12-02 00:00:00", 24},
		{"day's first instant", calendar.Day, utc, "2026-12-01 00:00:00", "2026-12-01 00:00:00", "2026-12-02 00:00:00", 24},
		{"day's last instant", calendar.Day, utc, "2026-12-01 23:59:59.999999999", "2026-12-01 00:00:00", "2026-12-02 00:00:00", 24},
		{"month of 31 days", calendar.Month, utc, "2026-01-31 23:59:59", "2026-01-01 00:00:00", "2026-02-01 00:00:00", 31 * 24},
		{"February", calendar.Month, utc, "2026-02-14 12:00:00", "2026-02-01 00:00:00", "2026-03-01 00:00:00", 28 * 24},
		{"February of a leap year", calendar.Month, utc, "2028-02-29 12:00:00", "2028-02-01 00:00:00", "2028-03-01 00:00:00", 29 * 24},
		{"December", calendar.Month, utc, "2026-12-31 23:59:59", "2026-12-01 00:00:00", "2027-01-01 00:00:00", 31 * 24},
		{"new year", calendar.Month, utc, "2027-01-01 00:00:00", "2027-01-01 00:00:00", "2027-02-01 00:00:00", 31 * 24},
		{"week from Monday", calendar.Week, utc, "2026-12-01 10:00:00", "2026-11-30 00:00:00", "2026-12-07 00:00:00", 7 * 24},
		{"week on its Monday", calendar.Week, utc, "2026-11-30 00:00:00", "2026-11-30 00:00:00", "2026-12-07 00:00:00", 7 * 24},
		{"week on its Sunday", calendar.Week, utc, "2026-12-06 23:59:59", "2026-11-30 00:00:00", "2026-12-07 00:00:00", 7 * 24},
		// ISO week 1 of 2026 starts on Monday 29 December 2025.
		{"week across a year end", calendar.Week, utc, "2026-01-01 12:00:00", "2025-12-29 00:00:00", "2026-01-05 00:00:00", 7 * 24},
		{"week across a year end, Sunday", calendar.Week, utc, "2027-01-03 12:00:00", "2026-12-28 00:00:00", "2027-01-04 00:00:00", 7 * 24},
		// Paris: summer time starts on 29 March 2026 (23 hours) and
		// ends on 25 October 2026 (25 hours).
		{"day of 23 hours", calendar.Day, paris, "2026-03-29 12:00:00", "2026-03-29 00:00:00", "2026-03-30 00:00:00", 23},
		{"day of 25 hours", calendar.Day, paris, "2026-10-25 02:30:00", "2026-10-25 00:00:00", "2026-10-26 00:00:00", 25},
		{"week with a day of 23 hours", calendar.Week, paris, "2026-03-29 23:00:00", "2026-03-23 00:00:00", "2026-03-30 00:00:00", 7*24 - 1},
		{"month with a day of 25 hours", calendar.Month, paris, "2026-10-31 23:59:00", "2026-10-01 00:00:00", "2026-11-01 00:00:00", 31*24 + 1},
		{"new year in Paris", calendar.Month, paris, "2026-12-31 23:30:00", "2026-12-01 00:00:00", "2027-01-01 00:00:00", 31 * 24},
		{"New York's day of 23 hours", calendar.Day, newYork, "2026-03-08 03:00:00", "2026-03-08 00:00:00", "2026-03-09 00:00:00", 23},
	} {
		t.Run(tc.name, func(t *testing.T) {
			now := at(tc.loc, tc.at)
			start, end := tc.p.Window(now, tc.loc)
			if want := at(tc.loc, tc.start); !start.Equal(want) {
				t.Errorf("start %v, want %v", start, want)
			}
			if want := at(tc.loc, tc.end); !end.Equal(want) {
				t.Errorf("end %v, want %v", end, want)
			}
			if got := end.Sub(start).Hours(); got != tc.hours {
				t.Errorf("%v hours, want %v", got, tc.hours)
			}
			// The same instant seen from UTC gives the same window.
			if s2, e2 := tc.p.Window(now.UTC(), tc.loc); !s2.Equal(start) || !e2.Equal(end) {
				t.Errorf("from UTC: %v-%v", s2, e2)
			}
		})
	}
}

// TestWindowsTile walks two years hour by hour, in zones whose
// midnights can be skipped or repeated, and checks that the windows hold
// their instants, start at a local midnight (or the day's first instant
// when a change skips midnight), and follow one another without gap or
// overlap.
func TestWindowsTile(t *testing.T) {
	for _, name := range []string{"UTC", "Europe/Paris", "America/Santiago", "America/Havana", "Asia/Kolkata", "Pacific/Apia", "Australia/Lord_Howe"} {
		loc := mustLoad(t, name)
		for _, p := range []calendar.Period{calendar.Day, calendar.Week, calendar.Month} {
			var lastEnd time.Time
			for tm := time.Date(2011, 12, 25, 0, 0, 0, 0, time.UTC); tm.Year() < 2013; tm = tm.Add(time.Hour) {
				start, end := p.Window(tm, loc)
				if tm.Before(start) || !tm.Before(end) {
					t.Fatalf("%s %d: %v not in [%v, %v)", name, p, tm, start, end)
				}
				if !lastEnd.IsZero() && start.After(lastEnd) {
					t.Fatalf("%s %d: gap between %v and %v", name, p, lastEnd, start)
				}
				if !lastEnd.IsZero() && !start.Equal(lastEnd) && start.Before(lastEnd) && !tm.Before(lastEnd) {
					t.Fatalf("%s %d: window %v-%v overlaps the last, which ended %v", name, p, start, end, lastEnd)
				}
				if h, m, _ := start.In(loc).Clock(); m != 0 || h > 1 {
					t.Fatalf("%s %d: window starts at %v, not at the day's start", name, p, start.In(loc))
				}
				if d := end.Sub(start); d < 22*time.Hour || d > 32*24*time.Hour {
					t.Fatalf("%s %d: window of %v", name, p, d)
				}
				lastEnd = end
			}
		}
	}
}

// TestWindowCache: the window of the last call is kept, and
// replaced at its end.
func TestWindowCache(t *testing.T) {
	ws := &calendar.Windows{Period: calendar.Day, Loc: time.UTC}
	now := time.Date(2026, 12, 1, 23, 59, 59, 0, time.UTC)
	w := ws.Window(now)
	if ws.Window(now.Add(time.Second-1)) != w {
		t.Fatal("a window was computed again within it")
	}
	next := ws.Window(now.Add(time.Second))
	if next == w || !next.Start.Equal(w.End) || next.Seconds != 86400 {
		t.Fatalf("next window %+v after %+v", next, w)
	}
	if got := [4]time.Time{next.Prev, next.Start, next.End, next.Next}; !got[0].Equal(w.Start) || !got[1].Equal(w.End) ||
		!got[3].Equal(w.End.Add(48*time.Hour)) {
		t.Fatalf("bounds %v", got)
	}
}
