package bench

import (
	"fmt"
	"image/color"
	"os"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// soakPlot draws the soak's fault timeline into a PNG at path: the answers per second (whole,
// refused by a tenant's limit, failed) above, each Baton's RSS below, every phase's start marked
// on both.
func soakPlot(path string, t *soakTally, samples []soakSample, marks []soakMark, names []string) error {
	t.mu.Lock()
	const bucket = 5 // seconds
	var ok, limited, failed plotter.XYs
	n := 0
	for _, s := range t.seconds {
		n = max(n, len(s))
	}
	for b := 0; b*bucket < n; b++ {
		var o, l, f int
		for _, secs := range t.seconds {
			for s := b * bucket; s < min(len(secs), (b+1)*bucket); s++ {
				o, l, f = o+secs[s].ok, l+secs[s].limited, f+secs[s].failed
			}
		}
		x := float64(b*bucket+bucket/2) / 60
		ok = append(ok, plotter.XY{X: x, Y: float64(o) / bucket})
		limited = append(limited, plotter.XY{X: x, Y: float64(l) / bucket})
		failed = append(failed, plotter.XY{X: x, Y: float64(f) / bucket})
	}
	t.mu.Unlock()

	answers := plot.New()
	answers.Title.Text = "Soak: answers per second under the fault schedule (phases numbered as in the report)"
	answers.X.Label.Text = "minutes"
	answers.Y.Label.Text = "answers / s"
	colors := []color.Color{color.RGBA{0x1b, 0x9e, 0x77, 0xff}, color.RGBA{0x75, 0x70, 0xb3, 0xff}, color.RGBA{0xd9, 0x5f, 0x02, 0xff}, color.RGBA{0xe7, 0x29, 0x8a, 0xff}}
	var top float64
	for i, series := range []struct {
		name string
		xys  plotter.XYs
	}{{"200 (whole, checked)", ok}, {"429 (tenant limit)", limited}, {"failed (503/504/502/5xx, cut)", failed}} {
		l, err := plotter.NewLine(series.xys)
		if err != nil {
			return err
		}
		l.Color = colors[i]
		l.Width = vg.Points(1.2)
		answers.Add(l)
		answers.Legend.Add(series.name, l)
		for _, p := range series.xys {
			top = max(top, p.Y)
		}
	}
	answers.Legend.Top = true
	answers.Y.Max = top * 1.45 // room above the lines for the phases' numbers and the legend

	memory := plot.New()
	memory.Title.Text = "RSS of each Baton"
	memory.X.Label.Text = "minutes"
	memory.Y.Label.Text = "MiB"
	var memTop float64
	for k, name := range names {
		var xys plotter.XYs
		for _, s := range samples {
			xys = append(xys, plotter.XY{X: s.at.Minutes(), Y: s.rssMiB[k]})
			memTop = max(memTop, s.rssMiB[k])
		}
		l, err := plotter.NewLine(xys)
		if err != nil {
			return err
		}
		l.Color = colors[k%len(colors)]
		l.Width = vg.Points(1.2)
		memory.Add(l)
		memory.Legend.Add(name, l)
	}
	memory.Legend.Top = true
	memory.Legend.Left = true
	memory.Y.Min = 0

	// The phases: a dashed line at each start, its name along it.
	for _, pl := range []struct {
		p   *plot.Plot
		top float64
	}{{answers, top}, {memory, memTop}} {
		var labels plotter.XYLabels
		for i, m := range marks {
			x := m.at.Minutes()
			line, err := plotter.NewLine(plotter.XYs{{X: x, Y: 0}, {X: x, Y: pl.top * 1.08}})
			if err != nil {
				return err
			}
			line.Dashes = []vg.Length{vg.Points(3), vg.Points(3)}
			line.Color = color.Gray{Y: 0x99}
			pl.p.Add(line)
			if pl.p == answers { // the phase's number: the report's table names it
				labels.XYs = append(labels.XYs, plotter.XY{X: x, Y: pl.top * 1.05})
				labels.Labels = append(labels.Labels, fmt.Sprintf(" %d", i+1))
			}
		}
		if len(labels.Labels) > 0 {
			lb, err := plotter.NewLabels(labels)
			if err != nil {
				return err
			}
			for i := range lb.TextStyle {
				lb.TextStyle[i].Font.Size = vg.Points(9)
			}
			pl.p.Add(lb)
		}
	}

	img := vgimg.New(vg.Points(1000), vg.Points(640))
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 2, Cols: 1, PadX: vg.Points(10), PadY: vg.Points(14), PadTop: vg.Points(6), PadBottom: vg.Points(6), PadLeft: vg.Points(6), PadRight: vg.Points(10)}
	canvases := plot.Align([][]*plot.Plot{{answers}, {memory}}, tiles, dc)
	answers.Draw(canvases[0][0])
	memory.Draw(canvases[1][0])
	return savePNG(path, img)
}

// savePNG writes img as a PNG file at path.
func savePNG(path string, img *vgimg.Canvas) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// goodputSeries is one line of the PD sizing plot: goodput for 1..7 prefill workers of eight.
type goodputSeries struct {
	name    string
	goodput []float64
}

// goodputPlot draws goodput per static split, one line per mix and mode, into a PNG at path.
func goodputPlot(path string, series []goodputSeries) error {
	p := plot.New()
	p.Title.Text = "PD sizing: goodput per static split of eight engines"
	p.X.Label.Text = "prefill workers (the rest decode)"
	p.Y.Label.Text = "goodput (requests/s meeting both SLOs)"
	colors := []color.Color{color.RGBA{0x1b, 0x9e, 0x77, 0xff}, color.RGBA{0x1b, 0x9e, 0x77, 0xff}, color.RGBA{0xd9, 0x5f, 0x02, 0xff}, color.RGBA{0xd9, 0x5f, 0x02, 0xff}}
	for i, s := range series {
		var xys plotter.XYs
		for j, g := range s.goodput {
			xys = append(xys, plotter.XY{X: float64(j + 1), Y: g})
		}
		l, pts, err := plotter.NewLinePoints(xys)
		if err != nil {
			return err
		}
		l.Color, pts.Color = colors[i%len(colors)], colors[i%len(colors)]
		l.Width = vg.Points(1.5)
		if i%2 == 1 {
			l.Dashes = []vg.Length{vg.Points(5), vg.Points(3)}
			pts.Shape = draw.BoxGlyph{}
		}
		p.Add(l, pts)
		p.Legend.Add(s.name, l, pts)
	}
	p.Legend.Top = true
	p.X.Min, p.X.Max = 0.5, 7.5
	p.Y.Min = 0
	img := vgimg.New(vg.Points(720), vg.Points(420))
	p.Draw(draw.New(img))
	return savePNG(path, img)
}
