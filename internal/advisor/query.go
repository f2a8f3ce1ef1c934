package advisor

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Query is a what-if asked of the advisor: a fleet of Total workers (0: the fleet's own) and
// the SLOs (0: the configured ones).
type Query struct {
	Total      int
	TTFT, TPOT time.Duration
}

// QueryError says which parameter of a what-if is wrong, and how.
type QueryError struct{ Param, Message string }

func (e *QueryError) Error() string { return e.Message }

// ParseQuery reads a what-if from a URL's raw query — total (2 to 10,000), ttft_slo and
// tpot_slo (Go durations, or decimal seconds, from 1ms to 1h) — refusing a query that cannot be
// read and a parameter given twice.
func ParseQuery(raw string) (Query, *QueryError) {
	var q Query
	vals, err := url.ParseQuery(raw)
	if err != nil {
		msg := err.Error()
		if len(msg) > 200 {
			msg = msg[:200]
		}
		return q, &QueryError{"", "the query cannot be read: " + strings.ToValidUTF8(msg, "")}
	}
	for name, vs := range vals {
		switch {
		case name != "total" && name != "ttft_slo" && name != "tpot_slo":
			return q, &QueryError{"", fmt.Sprintf("unknown parameter %q: the what-if takes total, ttft_slo and tpot_slo", strings.ToValidUTF8(clip(name, 64), ""))}
		case len(vs) > 1:
			return q, &QueryError{name, fmt.Sprintf("%s is given %d times: give it once", name, len(vs))}
		case vs[0] == "":
			return q, &QueryError{name, name + " is given no value: give one, or leave it out for the default"}
		}
	}
	if v := vals.Get("total"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 2 || n > 10_000 {
			return q, &QueryError{"total", "total must be a whole number of workers from 2 to 10000 (one of each role at least)"}
		}
		q.Total = n
	}
	for _, x := range []struct {
		name string
		to   *time.Duration
	}{{"ttft_slo", &q.TTFT}, {"tpot_slo", &q.TPOT}} {
		v := vals.Get(x.name)
		if v == "" {
			continue
		}
		d, err := time.ParseDuration(v)
		if err != nil && strings.Trim(v, "0123456789.") == "" { // seconds, in decimal
			if f, ferr := strconv.ParseFloat(v, 64); ferr == nil && f <= 3600 {
				d, err = time.Duration(f*float64(time.Second)), nil
			}
		}
		if err != nil || d < time.Millisecond || d > time.Hour {
			return q, &QueryError{x.name, x.name + " must be a duration from 1ms to 1h (e.g. 2s, 50ms, or seconds: 0.05)"}
		}
		*x.to = d
	}
	return q, nil
}

// clip cuts s to at most n bytes.
func clip(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}
