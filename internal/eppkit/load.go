package eppkit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/baton-llm/baton/internal/epp/dataplane"
)

// LoadResult is what a load run measured: picks per second, and the pick's latency as the data
// plane sees it (from the body's last byte to the headers' answer).
type LoadResult struct {
	Sent, Picked, Failed int
	Rate                 float64 // picks per second achieved
	P50, P99, Max        time.Duration
	FirstError           string
}

// Load runs whole exchanges (headers, a body, the pick, the body handed back, an empty response)
// at rate per second, open loop, for d; each exchange a distinct prompt.
func (k *Kit) Load(ctx context.Context, rate float64, d time.Duration) LoadResult {
	var (
		mu    sync.Mutex
		lat   []time.Duration
		res   LoadResult
		wg    sync.WaitGroup
		start = time.Now()
	)
	interval := time.Duration(float64(time.Second) / rate)
	for i := 0; time.Since(start) < d && ctx.Err() == nil; i++ {
		if wait := time.Until(start.Add(time.Duration(i) * interval)); wait > 0 {
			time.Sleep(wait)
		}
		res.Sent++
		wg.Go(func() {
			took, err := k.timedPick(ctx, i)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				res.Failed++
				if res.FirstError == "" {
					res.FirstError = err.Error()
				}
				return
			}
			res.Picked++
			lat = append(lat, took)
		})
	}
	wg.Wait()
	res.Rate = float64(res.Picked) / time.Since(start).Seconds()
	if len(lat) > 0 {
		slices.Sort(lat)
		res.P50, res.P99, res.Max = lat[len(lat)/2], lat[min(len(lat)-1, len(lat)*99/100)], lat[len(lat)-1]
	}
	return res
}

func (k *Kit) timedPick(ctx context.Context, i int) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, k.o.Timeout)
	defer cancel()
	st, err := k.client.Process(ctx)
	if err != nil {
		return 0, err
	}
	defer st.CloseSend()
	if err := st.Send(withMode(headers(http.MethodPost, k.o.Path, nil, false), fullDuplex)); err != nil {
		return 0, err
	}
	start := time.Now()
	if err := st.Send(dataplane.RequestBody(k.body(fmt.Sprintf("load %d: a prompt of a few words to route", i)), true)); err != nil {
		return 0, err
	}
	m, err := st.Recv()
	if err != nil {
		return 0, err
	}
	took := time.Since(start)
	p, err := readPick(m)
	if err == nil {
		err = wantPick(p)
	}
	if err != nil {
		return 0, err
	}
	for { // the body handed back
		m, err := st.Recv()
		if err != nil {
			return 0, err
		}
		if sr := m.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse(); sr == nil || sr.GetEndOfStream() {
			break
		}
	}
	for _, msg := range []*extprocv3.ProcessingRequest{respHeaders(200, "", false), dataplane.ResponseBody([]byte(`{}`), true)} {
		if err := st.Send(msg); err != nil {
			return 0, err
		}
		if _, err := st.Recv(); err != nil {
			return 0, err
		}
	}
	if took <= 0 {
		return 0, errors.New("no time measured")
	}
	return took, nil
}
