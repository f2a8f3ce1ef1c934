// Package bench is Baton's benchmark harness (`baton bench`): a load generator that times every
// SSE event at the client and checks every answer against the simulator's deterministic model,
// and scenarios that measure Baton against a baseline taken in the same run (the engine
// directly, the PD legs sent by the client itself, and nginx as a pure reverse proxy).
package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"
)

// Result is one request as the client saw it.
type Result struct {
	Err     error         // wrong status, broken or incomplete stream, or wrong text
	Latency time.Duration // send to the end of the answer
	TTFT    time.Duration // send to the first event (non-streamed: the whole answer)
	Gaps    []time.Duration
}

// Request sends request i and reports how it went.
type Request func(ctx context.Context, i int) Result

// Stats summarises a run.
type Stats struct {
	N, Errors  int
	FirstError error
	Elapsed    time.Duration
	Latency    Percentiles
	TTFT       Percentiles
	Gap        Percentiles
	// BurstGaps is the fraction of inter-event gaps under 200 µs: events that arrived together.
	BurstGaps float64
}

// Throughput is completed requests per second.
func (s Stats) Throughput() float64 { return float64(s.N-s.Errors) / s.Elapsed.Seconds() }

// Percentiles of a duration sample.
type Percentiles struct{ P50, P90, P99, Mean time.Duration }

func percentiles(d []time.Duration) Percentiles {
	if len(d) == 0 {
		return Percentiles{}
	}
	slices.Sort(d)
	at := func(q float64) time.Duration { return d[min(len(d)-1, int(q*float64(len(d))))] }
	var sum time.Duration
	for _, x := range d {
		sum += x
	}
	return Percentiles{P50: at(0.50), P90: at(0.90), P99: at(0.99), Mean: sum / time.Duration(len(d))}
}

func summarise(results []Result, elapsed time.Duration) Stats {
	s := Stats{N: len(results), Elapsed: elapsed}
	var lat, ttft, gaps []time.Duration
	for _, r := range results {
		if r.Err != nil {
			s.Errors++
			if s.FirstError == nil {
				s.FirstError = r.Err
			}
			continue
		}
		lat, ttft = append(lat, r.Latency), append(ttft, r.TTFT)
		gaps = append(gaps, r.Gaps...)
	}
	if len(gaps) > 0 {
		small := 0
		for _, g := range gaps {
			if g < 200*time.Microsecond {
				small++
			}
		}
		s.BurstGaps = float64(small) / float64(len(gaps))
	}
	s.Latency, s.TTFT, s.Gap = percentiles(lat), percentiles(ttft), percentiles(gaps)
	return s
}

// ClosedLoop runs n requests with `concurrency` clients sending back to back.
func ClosedLoop(ctx context.Context, req Request, concurrency, n int) Stats {
	results := make([]Result, n)
	next := make(chan int)
	var wg sync.WaitGroup
	start := time.Now()
	for c := 0; c < concurrency; c++ {
		wg.Go(func() {
			for i := range next {
				results[i] = req(ctx, i)
			}
		})
	}
	for i := 0; i < n; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
	return summarise(results, time.Since(start))
}

// OpenLoop sends n requests at a fixed rate per second, whatever the answers do.
func OpenLoop(ctx context.Context, req Request, rate float64, n int) Stats {
	results := make([]Result, n)
	var wg sync.WaitGroup
	interval := time.Duration(float64(time.Second) / rate)
	start := time.Now()
	for i := 0; i < n; i++ {
		if d := time.Until(start.Add(time.Duration(i) * interval)); d > 0 {
			time.Sleep(d)
		}
		wg.Go(func() { results[i] = req(ctx, i) })
	}
	wg.Wait()
	return summarise(results, time.Since(start))
}

// post sends body and reads the answer, timing each SSE event as it arrives.
func post(ctx context.Context, client *http.Client, url string, body []byte, hdr http.Header) (status int, out []byte, r Result) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		r.Err = err
		return 0, nil, r
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header[k] = v
	}
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		r.Err = err
		return 0, nil, r
	}
	defer resp.Body.Close()
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		out, err = io.ReadAll(resp.Body)
		r.Latency = time.Since(start)
		r.TTFT, r.Err = r.Latency, err
		return resp.StatusCode, out, r
	}
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	var buf bytes.Buffer
	last := time.Time{}
	for {
		line, err := br.ReadBytes('\n')
		buf.Write(line)
		if bytes.HasPrefix(line, []byte("data: ")) {
			now := time.Now()
			if last.IsZero() {
				r.TTFT = now.Sub(start)
			} else {
				r.Gaps = append(r.Gaps, now.Sub(last))
			}
			last = now
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			r.Err = fmt.Errorf("stream broken: %w", err)
			return resp.StatusCode, buf.Bytes(), r
		}
	}
	r.Latency = time.Since(start)
	return resp.StatusCode, buf.Bytes(), r
}

// completionText extracts choices[0].text of a completion, streamed (all events, which must end
// with [DONE]) or not.
func completionText(body []byte, stream bool) (string, error) {
	if !stream {
		var v struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(body, &v); err != nil || len(v.Choices) == 0 {
			return "", fmt.Errorf("not a completion: %.200s", body)
		}
		return v.Choices[0].Text, nil
	}
	if !bytes.HasSuffix(body, []byte("data: [DONE]\n\n")) {
		return "", fmt.Errorf("stream does not end with [DONE]: %.200s", body)
	}
	var sb strings.Builder
	for _, ev := range strings.Split(string(body), "\n\n") {
		d, ok := strings.CutPrefix(ev, "data: ")
		if !ok || d == "[DONE]" {
			continue
		}
		var v struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if json.Unmarshal([]byte(d), &v) == nil && len(v.Choices) > 0 {
			sb.WriteString(v.Choices[0].Text)
		}
	}
	return sb.String(), nil
}
