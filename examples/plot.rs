//! Plots benchmark records (the JSON of `examples/bench.rs` and `benches/torch_sdpa.py`):
//! TFLOP/s against sequence length, one PNG per (dtype, pass) with a panel per head dim and
//! causal setting, a line per implementation.
//!
//!     cargo run --release --example plot -- docs/benchmarks/h200.json --out docs/benchmarks
//!
//! Text is drawn with a TrueType font read at run time (`--font`, default DejaVu Sans from
//! Debian's `fonts-dejavu-core`).

use std::collections::BTreeSet;
use std::path::PathBuf;

use clap::Parser;
use plotters::prelude::*;
use serde_json::Value;

#[derive(Parser, Debug)]
#[command(about = "Plot flash-attention benchmark records")]
struct Args {
    /// JSON files of records (headers are skipped).
    inputs: Vec<PathBuf>,
    /// Folder for the PNGs.
    #[arg(long, default_value = ".")]
    out: PathBuf,
    /// TrueType font for the labels.
    #[arg(
        long,
        default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
    )]
    font: PathBuf,
}

struct Point {
    implementation: String,
    pass: String,
    dtype: String,
    d: u64,
    causal: bool,
    s: u64,
    tflops: f64,
}

fn points(args: &Args) -> Vec<Point> {
    let mut out = Vec::new();
    for path in &args.inputs {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        let records: Vec<Value> = serde_json::from_str(&text).expect("a JSON array of records");
        for r in records {
            if r.get("header").is_some() || r["h"] != r["h_kv"] || r["s_q"] != r["s_kv"] {
                continue; // the plots compare plain self-attention shapes
            }
            out.push(Point {
                implementation: r["impl"].as_str().unwrap().into(),
                pass: r["pass"].as_str().unwrap().into(),
                dtype: r["dtype"].as_str().unwrap().into(),
                d: r["d"].as_u64().unwrap(),
                causal: r["causal"].as_bool().unwrap(),
                s: r["s_q"].as_u64().unwrap(),
                tflops: r["tflops"].as_f64().unwrap(),
            });
        }
    }
    out
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let font: &'static [u8] = Box::leak(std::fs::read(&args.font)?.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| "the font could not be loaded")?;
    let points = points(&args);
    let impls: Vec<String> = points
        .iter()
        .map(|p| p.implementation.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let groups: BTreeSet<(String, String)> = points
        .iter()
        .map(|p| (p.dtype.clone(), p.pass.clone()))
        .collect();
    std::fs::create_dir_all(&args.out)?;
    for (dtype, pass) in groups {
        let mine: Vec<&Point> = points
            .iter()
            .filter(|p| p.dtype == dtype && p.pass == pass)
            .collect();
        let dims: Vec<u64> = mine
            .iter()
            .map(|p| p.d)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let path = args.out.join(format!("{dtype}_{pass}.png"));
        let root = BitMapBackend::new(&path, (1200, 450 * dims.len() as u32)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(
            &format!("{dtype} {pass}: TFLOP/s against sequence length"),
            ("sans-serif", 28),
        )?;
        let panels = root.split_evenly((dims.len(), 2));
        for (i, panel) in panels.iter().enumerate() {
            let (d, causal) = (dims[i / 2], i % 2 == 1);
            let here: Vec<&&Point> = mine
                .iter()
                .filter(|p| p.d == d && p.causal == causal)
                .collect();
            let max_s = here.iter().map(|p| p.s).max().unwrap_or(1024) as f64;
            let min_s = here.iter().map(|p| p.s).min().unwrap_or(512) as f64;
            let max_t = here.iter().map(|p| p.tflops).fold(1.0, f64::max) * 1.1;
            let mut chart = ChartBuilder::on(panel)
                .caption(format!("d = {d}, causal = {causal}"), ("sans-serif", 22))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(60)
                .build_cartesian_2d((min_s.log2() - 0.2)..(max_s.log2() + 0.2), 0.0..max_t)?;
            chart
                .configure_mesh()
                .x_desc("sequence length")
                .y_desc("TFLOP/s")
                .x_label_formatter(&|x| format!("{}", 2f64.powf(x.round()) as u64))
                .x_labels(((max_s / min_s).log2() as usize + 1).max(2))
                .label_style(("sans-serif", 16))
                .draw()?;
            for (n, imp) in impls.iter().enumerate() {
                let mut line: Vec<(f64, f64)> = here
                    .iter()
                    .filter(|p| &p.implementation == imp)
                    .map(|p| ((p.s as f64).log2(), p.tflops))
                    .collect();
                if line.is_empty() {
                    continue;
                }
                line.sort_by(|a, b| a.0.total_cmp(&b.0));
                let color = COLORS[n % COLORS.len()];
                chart
                    .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
                    .label(imp.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                    });
                chart.draw_series(line.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .label_font(("sans-serif", 16))
                .draw()?;
        }
        root.present()?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
